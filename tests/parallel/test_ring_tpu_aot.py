"""Ring attention with the Pallas TPU kernels inside, compiled for a real TPU slice
on this CPU machine (libtpu topologies, as tests/ops/test_mosaic_tpu_aot.py does for
the single-device kernels): the ring's collective-permutes, its while loop and the
Mosaic kernels of every step go through the real XLA:TPU and Mosaic compilers.
Per-device memory must stay flat as the total length grows with the device count.
Skipped when libtpu is missing."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers share libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks
from tfjax.parallel.ring_attention import ring_attention

# Real XLA:TPU / Mosaic compilation and its memory: XLA's full pipeline, as production.
pytestmark = pytest.mark.xla_optimized

TOPOLOGY = "v5p:2x2x2"  # 8 chips
TOKENS_PER_DEVICE, N, K, H = 1024, 8, 2, 128


@pytest.fixture(scope="module")
def tpu_devices():
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY)
    except Exception as e:  # noqa: BLE001 - no libtpu, or it cannot describe this slice
        pytest.skip(f"no TPU topology {TOPOLOGY!r} (is libtpu installed? `pip install "
                    f"'jax[tpu]'`): {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return np.array(topo.devices).reshape(-1)


def compile_ring(devices, n, tokens_per_device=TOKENS_PER_DEVICE, load_balance="zigzag",
                 relative=False):
    """The ring's gradient; `relative`: with T5's bias at index positions (its
    table differentiated too)."""
    from tfjax.ops import RelativeBias
    mesh = Mesh(devices[:n], ("sequence",))
    S = n * tokens_per_device
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=NamedSharding(mesh, P(None, "sequence")))
    sh = NamedSharding(mesh, P(None, "sequence"))
    args = (jax.ShapeDtypeStruct((1, S, N, H), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.bfloat16, sharding=sh), seg,
            jax.ShapeDtypeStruct((32, N), jnp.float32, sharding=NamedSharding(mesh, P())))

    def loss(q, k, v, ids, table):  # packed documents, causal, zig-zag order
        rel = RelativeBias(table, bidirectional=False) if relative else None
        out = ring_attention(q, k, v, masks.causal() & masks.segments(ids), mesh=mesh,
                             load_balance=load_balance, natural_order=False,
                             relative_bias=rel)
        return out.astype(jnp.float32).sum()

    argnums = (0, 1, 2, 4) if relative else (0, 1, 2)
    return jax.jit(jax.grad(loss, argnums)).lower(*args).compile()


@pytest.mark.parametrize("relative", [False, True], ids=["plain", "t5"])
def test_ring_with_pallas_compiles_for_v5p_and_memory_is_flat(tpu_devices, relative):
    temps = {}
    for n in (4, 8):  # (T5's variant at half the tokens per device, for the suite's time)
        compiled = compile_ring(tpu_devices, n, relative=relative,
                                tokens_per_device=TOKENS_PER_DEVICE // (2 if relative else 1))
        hlo = compiled.as_text()
        assert "collective-permute" in hlo and "all-gather" not in hlo
        assert "tpu_custom_call" in hlo  # the Mosaic kernels, not an XLA fallback
        temps[n] = compiled.memory_analysis().temp_size_in_bytes
    # Twice the total length on twice the chips: per-chip temporaries stay flat (the
    # steps run as a while loop on TPU: one K/V block in flight, whatever n is).
    assert temps[8] <= 1.02 * temps[4], temps


def test_ulysses_with_pallas_compiles_for_v5p(tpu_devices):
    """Ulysses on 8 chips (8 query heads: one a chip; 2 kv heads repeated to 8): the
    gradient of packed causal attention goes through XLA:TPU with all-to-alls, the
    Mosaic kernels on each chip's heads, and no all-gather but the int32 segment ids'."""
    from tfjax.parallel.ulysses import ulysses_attention
    mesh = Mesh(tpu_devices[:8], ("sequence",))
    S = 8 * TOKENS_PER_DEVICE
    sh = NamedSharding(mesh, P(None, "sequence"))
    args = (jax.ShapeDtypeStruct((1, S, N, H), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((1, S, K, H), jnp.bfloat16, sharding=sh),
            jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=sh))

    def loss(q, k, v, ids):
        out = ulysses_attention(q, k, v, masks.causal() & masks.segments(ids), mesh=mesh,
                                implementation="pallas")
        return out.astype(jnp.float32).sum()

    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile().as_text()
    assert "all-to-all" in hlo and "tpu_custom_call" in hlo
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and "= " in line]
    assert all("bf16[" not in line for line in gathers), gathers


def test_usp_with_pallas_compiles_for_v5p(tpu_devices):
    """USP on 8 chips as 4 ring groups x 2 Ulysses chips: all-to-alls inside the
    groups, the ring's collective-permutes across them, the Mosaic kernels per block."""
    from tfjax.parallel.ulysses import usp_attention
    mesh = Mesh(tpu_devices[:8], ("sequence",))
    S = 8 * TOKENS_PER_DEVICE
    sh = NamedSharding(mesh, P(None, "sequence"))
    args = [jax.ShapeDtypeStruct((1, S, h, H), jnp.bfloat16, sharding=sh) for h in (N, K, K)]

    def loss(q, k, v):
        out = usp_attention(q, k, v, masks.causal(), mesh=mesh, ulysses_size=2,
                            implementation="pallas")
        return out.astype(jnp.float32).sum()

    hlo = jax.jit(jax.grad(loss, (0, 1, 2)), in_shardings=(sh,) * 3).lower(*args).compile()
    text = hlo.as_text()
    assert "all-to-all" in text and "collective-permute" in text and "tpu_custom_call" in text
    assert "all-gather" not in text
