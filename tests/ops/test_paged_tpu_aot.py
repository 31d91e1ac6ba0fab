"""The paged attention kernel compiled by the real Mosaic compiler on this CPU machine
(libtpu's topology descriptions, the `tpu` extra; skipped without it), which enforces
the layout and tiling rules interpret mode does not: paged calls through
`dot_product_attention(implementation="auto")` on a TPU target (each device on its
rows, every page on every device) for decode and chunk steps, GQA / MQA, MLA's head
dims, a window, soft-cap, sinks, one and several query tiles, bf16 and f32; and a
cache step (the new keys written into the pools as the KV cache stores them, then
attended) compiles to the kernel with no copy of a pool."""

import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers share libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax.nn.attention import KV_AXES
from tfjax.nn.state import Slots, cached_attention, slots_major
from tfjax.ops import dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops.paged import Paged

# Real XLA:TPU / Mosaic compilation: XLA's full pipeline, as production.
pytestmark = pytest.mark.xla_optimized

KERNEL = "tfjax_paged_attention"


def _mesh(devices: int, topology: str = "v5e:2x2") -> Mesh:
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - no libtpu, or it cannot describe this slice
        pytest.skip(f"no TPU topology {topology} (is libtpu installed? `pip install "
                    f"'jax[tpu]'`): {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return Mesh(np.array(topo.devices[:devices]).reshape(-1), ("data",))


def _sds(mesh, shape, dtype, spec=P()):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


CASES = {  # B, T, (N, K), H, Hv, page, pages per row, pool pages, dtype, extras
    "decode-gqa-bf16": (8, 1, (8, 2), 128, 128, 16, 64, 600, jnp.bfloat16, {}),
    "decode-gqa-bf16-v5p": (8, 1, (32, 8), 128, 128, 16, 64, 600, jnp.bfloat16,
                            dict(topology="v5p:2x2x1")),
    "chunk-window-softcap-sinks": (4, 16, (16, 4), 128, 128, 32, 16, 80, jnp.bfloat16,
                                   dict(window=100, softcap=30.0, sinks=True)),
    "decode-mla-576-512": (4, 1, (16, 1), 576, 512, 16, 16, 80, jnp.bfloat16, {}),
    "prefill-chunk-two-row-tiles-f32": (4, 80, (8, 2), 64, 64, 16, 32, 80, jnp.float32, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_auto_runs_the_paged_kernel_for_paged_calls_on_tpu(name):
    B, T, (N, K), H, Hv, page, n, pool, dtype, x = CASES[name]
    mesh = _mesh(4, x.get("topology", "v5e:2x2"))
    row = P("data")
    sinks = jnp.linspace(-1.0, 2.0, N) if x.get("sinks") else None

    def local(q, k_pool, v_pool, table, q_pos, kv_pos):
        mask = M.positions(q_pos, kv_pos, window=x.get("window", 0))
        return dot_product_attention(q, Paged(k_pool, table), Paged(v_pool, table), mask,
                                     softcap=x.get("softcap"), sinks=sinks, return_lse=True)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(row, P(), P(), row, row, row),
                               out_specs=(row, row), check_vma=False))
    args = (_sds(mesh, (B, T, N, H), dtype, row), _sds(mesh, (pool, page, K, H), dtype),
            _sds(mesh, (pool, page, K, Hv), dtype), _sds(mesh, (B, n), jnp.int32, row),
            _sds(mesh, (B, T), jnp.int32, row), _sds(mesh, (B, n * page), jnp.int32, row))
    hlo = fn.lower(*args).compile().as_text()
    assert "tpu_custom_call" in hlo and KERNEL in hlo


def test_the_engine_ragged_call_runs_the_kernel_once_per_run():
    """The engine's ragged step (`Paged.runs`: 2 runs of 16 queries, then 8 single
    rows, one query a row) compiles to two kernel calls, the runs' as rows of 16
    queries (`paged.by_runs`), not one per query."""
    mesh = _mesh(1)
    R, C, singles, N, K, H, page, n, pool = 2, 16, 8, 8, 2, 128, 16, 32, 80
    B = R * C + singles

    def ragged(q, k_pool, v_pool, table, q_pos, kv_pos):
        k, v = (Paged(x, table, runs=(R, C)) for x in (k_pool, v_pool))
        return dot_product_attention(q, k, v, M.positions(q_pos, kv_pos), return_lse=True)

    fn = jax.jit(jax.shard_map(ragged, mesh=mesh, in_specs=P(), out_specs=P(),
                               check_vma=False))
    sds = lambda shape, dt=jnp.bfloat16: _sds(mesh, shape, dt)  # noqa: E731
    lowered = fn.lower(sds((B, 1, N, H)), sds((pool, page, K, H)), sds((pool, page, K, H)),
                       sds((B, n), jnp.int32), sds((B, 1), jnp.int32),
                       sds((B, n * page), jnp.int32))
    hlo = lowered.compile().as_text()
    calls = re.findall(r'custom_call_target="tpu_custom_call"', hlo)
    assert KERNEL in hlo and len(calls) == 2, len(calls)


def test_a_cache_step_writes_and_attends_the_stored_pools_in_place():
    """The KV cache's paged step (`cached_attention`: write the step's keys, then attend
    with `Paged` views of the heads-major pools `[P, K, page, H]`) with the pools
    donated: the kernel reads the stored pages (the views' swaps cancel), the writes
    scatter into them in place, and no op makes anything the size of a pool but the
    two scatters (no copy, no transpose, no temporary pool)."""
    mesh = _mesh(1)
    B, T, N, K, H, page, n, pages = 8, 4, 8, 2, 128, 16, 64, 16384
    dtype = jnp.bfloat16

    def step(q, k_new, v_new, k_store, v_store, table, index, q_pos, kv_pos):
        slots = Slots(jnp.full((B,), T, jnp.int32), index=index, table=table, mode="paged")
        mask = M.positions(q_pos, kv_pos)

        def attend(arrays, cached):
            return dot_product_attention(q, *arrays, mask)

        out, (k, v) = cached_attention((slots_major(k_store), slots_major(v_store)),
                                       (k_new, v_new), slots, KV_AXES, attend)
        return out, slots_major(k), slots_major(v)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False),
                 donate_argnums=(3, 4))
    sds = lambda shape, dt=dtype: _sds(mesh, shape, dt)  # noqa: E731
    compiled = fn.lower(sds((B, T, N, H)), sds((B, T, K, H)), sds((B, T, K, H)),
                        sds((pages, K, page, H)), sds((pages, K, page, H)),
                        sds((B, n), jnp.int32), sds((B, T), jnp.int32), sds((B, T), jnp.int32),
                        sds((B, n * page), jnp.int32)).compile()
    hlo = compiled.as_text()
    assert KERNEL in hlo
    pool = pages * K * page * H
    big = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} ([\w-]+)\(", line)
        if m and np.prod([int(d) for d in m.group(1).split(",")]) >= pool:
            big.append(m.group(2))
    assert {"copy", "transpose"}.isdisjoint(big), big
    assert big.count("scatter") == 2, big
    assert compiled.memory_analysis().temp_size_in_bytes < pool * 2 // 8  # no pool-sized temp
