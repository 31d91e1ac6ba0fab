"""Real Mosaic compilation of the TPU kernels on this CPU machine.

With libtpu installed (the `tpu` extra), `get_topology_desc` describes a TPU
slice without one, and `jit(...).lower(...).compile()` runs the real Mosaic
compiler, which enforces the layout and tiling rules interpret mode does not.
Every kernel (forward, dq, dk/dv, via the gradient) is compiled inside a
`shard_map` over the topology's devices (batch-sharded), and the compiled
per-device memory is checked to stay O(T). Skipped when libtpu is missing.
"""

import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers share libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks as M
from tfjax.ops import sparse_masks as SM
from tfjax.ops.pallas import BlockSizes, flash_attention_tpu

# Real XLA:TPU / Mosaic compilation and its memory: XLA's full pipeline, as production.
pytestmark = pytest.mark.xla_optimized

_TOPOLOGIES = {}


def _mesh(name):
    if name not in _TOPOLOGIES:
        try:
            from jax.experimental import topologies
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # noqa: BLE001 - no libtpu, or it cannot describe this slice
            pytest.skip(f"no TPU topology {name!r} (is libtpu installed? `pip install "
                        f"'jax[tpu]'`): {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        _TOPOLOGIES[name] = Mesh(np.array(topo.devices).reshape(-1), ("data",))
    return _TOPOLOGIES[name]


def _shard_map(f, mesh, in_specs, out_specs):
    # jax.shard_map is the public name since 0.7; check_vma since 0.7 as well
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def compile_attention(topology, *, T, S, N, K, H, dtype, mask_name, softcap=None, bias=False,
                      alibi=False, relative=None, grad=True, block_sizes=None, Hv=None,
                      sinks=False):
    """`relative`: T5's bias, "index" (causal buckets at the index positions) or "pos"
    (bidirectional, the segment-id operands as explicit positions); its table, an
    argument, is differentiated too. `Hv`: v's head dim (default H). `sinks`: learned
    sinks added to the kernels' (out, lse) as the dispatch adds them (the backward
    then takes the logsumexp's cotangent)."""
    from tfjax.ops import RelativeBias
    from tfjax.ops.sinks import add_sinks
    Hv = Hv or H
    mesh = _mesh(topology)
    D = mesh.devices.size
    B = D  # one example per device

    def local(q, k, v, q_seg, kv_seg, b, table):
        mask = {"none": None, "causal": M.causal(), "window": M.sliding_window(256, 32),
                "chunked": M.chunked_causal(512), "prefix": M.prefix_lm(q_seg[:, 0] * 0 + 100),
                "segments": M.segments(q_seg, kv_seg),
                "causal&segments": M.causal() & M.segments(q_seg, kv_seg),
                "padding": M.padding(kv_seg[:, 0] * 0 + S // 2),
                # global flags as operands; random blocks by an in-kernel int32 hash
                "longformer&causal": M.causal() & SM.longformer(128, (0, 1, 500)),
                "bigbird": SM.bigbird(64, 2, 2, 128, seed=3, seq_len=max(T, S))}[mask_name]

        slopes = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32) if alibi else None

        def f(q, k, v, b, table):
            rel = None
            if relative:
                pos = (q_seg, kv_seg) if relative == "pos" else (None, None)
                rel = RelativeBias(table, bidirectional=relative == "pos", max_distance=128,
                                   q_positions=pos[0], kv_positions=pos[1])
            out = flash_attention_tpu(q, k, v, mask, bias=b, softcap=softcap, interpret=False,
                                      alibi_slopes=slopes, relative_bias=rel,
                                      block_sizes=block_sizes, return_lse=sinks)
            if sinks:
                out = add_sinks(*out, jnp.linspace(-1.0, 2.0, N))[0].astype(q.dtype)
            return out

        if not grad:
            return f(q, k, v, b, table)
        loss = lambda *a: f(*a).astype(jnp.float32).sum()
        argnums = (0, 1, 2) + ((3,) if bias else ()) + ((4,) if relative else ())
        return jax.grad(loss, argnums)(q, k, v, b, table)

    spec = P("data")
    sds = lambda shape, dt, s=spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, s))
    args = (sds((B, T, N, H), dtype), sds((B, S, K, H), dtype), sds((B, S, K, Hv), dtype),
            sds((B, T), jnp.int32), sds((B, S), jnp.int32),
            sds((B, N, T, S), jnp.float32) if bias else None,
            sds((32, N), jnp.float32, P()) if relative else None)
    in_specs = (spec,) * 5 + ((spec,) if bias else (None,)) + ((P(),) if relative else (None,))
    out_specs = spec
    if grad and relative:  # the table's gradient: one partial sum per device
        out_specs = (spec,) * (3 + bool(bias)) + (P(),)
    fn = jax.jit(_shard_map(local, mesh, in_specs, out_specs))
    return fn.lower(*args).compile()


CASES = [  # (topology, mask, (N, K), H, dtype, extras)
    ("v5e:2x2", "causal", (8, 2), 128, jnp.bfloat16, {}),
    ("v5e:2x2", "causal&segments", (4, 4), 64, jnp.float32, {}),
    ("v5e:2x2", "window", (8, 1), 256, jnp.bfloat16, {"softcap": 30.0}),
    ("v5e:2x2", "padding", (4, 2), 80, jnp.float32, {"bias": True}),
    ("v5p:2x2x1", "causal", (8, 2), 128, jnp.bfloat16, {"alibi": True}),  # slopes in SMEM
    ("v5e:2x2", "bigbird", (8, 2), 128, jnp.bfloat16, {}),
    ("v5p:2x2x1", "longformer&causal", (4, 4), 64, jnp.float32, {}),
    # T5's bias: table in SMEM, buckets per tile, the dq kernel's per-bucket sums
    ("v5e:2x2", "causal", (8, 2), 128, jnp.bfloat16, {"relative": "index"}),
    ("v5p:2x2x1", "causal&segments", (4, 4), 64, jnp.float32, {"relative": "pos"}),
    # DeepSeek's head dims (q/k 192, v 128: both padded to 256 lanes) with gpt-oss's sinks
    ("v5e:2x2", "causal", (8, 2), 192, jnp.bfloat16, {"Hv": 128, "sinks": True}),
]


@pytest.mark.parametrize("topology,mask_name,heads,H,dtype,extras", CASES,
                         ids=[f"{c[0]}-{c[1]}-NK{c[2][0]}x{c[2][1]}-H{c[3]}-"
                              f"{jnp.dtype(c[4]).name}" + ("-t5" if "relative" in c[5] else "")
                              + ("-hv-sinks" if "sinks" in c[5] else "")
                              for c in CASES])
def test_tpu_kernels_compile(topology, mask_name, heads, H, dtype, extras):
    compiled = compile_attention(topology, T=1000, S=1000, N=heads[0], K=heads[1], H=H,
                                 dtype=dtype, mask_name=mask_name, **extras)
    assert compiled.memory_analysis() is not None


@pytest.mark.parametrize("relative,lengths", [(None, (2048, 8192)), ("index", (1024, 4096))],
                         ids=["plain", "t5"])
def test_compiled_memory_is_linear_in_T(relative, lengths):
    temps = []
    for T in lengths:
        c = compile_attention("v5e:2x2", T=T, S=T, N=8, K=2, H=128, dtype=jnp.bfloat16,
                              mask_name="causal", relative=relative,
                              block_sizes=BlockSizes(*(512,) * 6))
        m = c.memory_analysis()
        temps.append(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)
    assert temps[1] < 6 * temps[0], temps  # O(T*S) would be 16x


SWEEP = [  # every mask kind, head dims 64/128/256, f32 and bf16, three chips
    ("v5e:2x2", "none", 64, jnp.float32),
    ("v5e:2x2", "window", 128, jnp.bfloat16),
    ("v5e:2x2", "chunked", 256, jnp.float32),
    ("v5e:2x2", "prefix", 64, jnp.bfloat16),
    ("v5e:2x2", "segments", 128, jnp.float32),
    ("v5p:2x2x1", "causal&segments", 256, jnp.bfloat16),
    ("v5p:2x2x1", "padding", 128, jnp.float32),
    ("v6e:2x2", "causal", 256, jnp.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("topology,mask_name,H,dtype", SWEEP,
                         ids=[f"{c[0]}-{c[1]}-H{c[2]}-{jnp.dtype(c[3]).name}" for c in SWEEP])
def test_tpu_kernels_compile_sweep(topology, mask_name, H, dtype):
    compile_attention(topology, T=640, S=768, N=8, K=2, H=H, dtype=dtype, mask_name=mask_name,
                      softcap=30.0 if mask_name == "window" else None)


def test_auto_under_a_tpu_mesh_compiles_the_kernels_per_device():
    """What the trainer's AOT compile for a TPU slice builds: traced under the slice's
    mesh (`use_rules`), attention dispatch targets the TPU (`target_platform`; this
    machine's default backend is the CPU) and picks the Pallas kernels, which run in
    shard_map over the batch axis: the compiled program holds the Mosaic kernels on
    each chip's own examples (its per-chip arguments) and no all-gather."""
    from tfjax.ops import dot_product_attention
    from tfjax.ops.target import target_platform
    from tfjax.parallel.sharding import use_rules

    mesh = _mesh("v5e:2x2")
    D = mesh.devices.size
    sh = jax.sharding.NamedSharding(mesh, P("data"))
    q = jax.ShapeDtypeStruct((2 * D, 512, 8, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((2 * D, 512, 2, 128), jnp.bfloat16, sharding=sh)
    seen = []

    def loss(q, k, v):
        with use_rules(mesh, [("batch", "data")]):
            seen.append(target_platform())
            return dot_product_attention(q, k, v, M.causal()).astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    text = compiled.as_text()
    assert seen == ["tpu"]
    assert text.count("tpu_custom_call") >= 3 and "all-gather" not in text  # fwd, dq, dk/dv
    per_chip = 2 * 512 * (8 + 2 * 2) * 128 * 2  # q, k, v of two examples, bf16
    assert compiled.memory_analysis().argument_size_in_bytes == per_chip


def test_explicit_pallas_compiled_for_a_tpu_runs_mosaic_whatever_the_host():
    """`implementation="pallas"` compiled for a TPU from this CPU host runs the Mosaic
    kernels or raises, never interpret mode: inside a shard_map over the topology's
    devices with no mesh context (the abstract mesh names the TPU), Mosaic; in a jit
    whose inputs carry the topology's shardings, outside a shard_map, a one-line
    error (Mosaic kernels are not partitioned automatically); lowered for "tpu" with
    nothing naming the target, the kernel calls are staged for both platforms:
    lowering for the TPU takes Mosaic's (which raises here for want of a chip to
    lower for), lowering for the CPU the interpreted ones."""
    from tfjax.ops import dot_product_attention

    mesh = _mesh("v5e:2x2")
    D = mesh.devices.size
    sh = NamedSharding(mesh, P("data"))
    shapes = [(D, 256, 4, 64), (D, 256, 2, 64), (D, 256, 2, 64)]

    def grads(q, k, v):
        loss = lambda *a: dot_product_attention(*a, M.causal(), implementation="pallas").astype(
            jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    sharded = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh) for s in shapes]
    in_shard_map = jax.jit(_shard_map(grads, mesh, (P("data"),) * 3, (P("data"),) * 3))
    assert in_shard_map.lower(*sharded).compile().as_text().count("tpu_custom_call") >= 3
    with pytest.raises(ValueError, match="not inside a shard_map"):
        jax.jit(grads).lower(*sharded)
    plain = jax.jit(grads).trace(*[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes])
    with pytest.raises(ValueError, match="TPU device kind"):  # Mosaic's, not interpreted
        plain.lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" not in plain.lower(lowering_platforms=("cpu",)).as_text()


def test_auto_in_a_plain_jit_decides_by_the_inputs_tpu_mesh(monkeypatch):
    """`implementation="auto"` in a plain jit (no use_rules, no shard_map) whose inputs
    carry a TPU topology's shardings targets the TPU, not this CPU host: the request
    names "tpu", and since nothing runs the Pallas kernels per device there, auto
    takes TPU's next partitionable choice (xla), which XLA splits over the chips."""
    from tfjax.ops import attention as attention_lib
    from tfjax.ops import dot_product_attention

    mesh = _mesh("v5e:2x2")
    D = mesh.devices.size
    sh = NamedSharding(mesh, P("data"))
    shapes = [(D, 256, 4, 64), (D, 256, 2, 64), (D, 256, 2, 64)]
    chosen = []
    select = attention_lib.select_implementation

    def spy(request, implementation="auto"):
        chosen.append((request.backend, request.sharded_without_runner,
                       select(request, implementation)))
        return chosen[-1][-1]

    monkeypatch.setattr(attention_lib, "select_implementation", spy)

    def loss(q, k, v):
        return dot_product_attention(q, k, v, M.causal()).astype(jnp.float32).sum()

    sharded = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh) for s in shapes]
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*sharded).compile()
    assert chosen == [("tpu", True, "xla")]
    assert "tpu_custom_call" not in compiled.as_text()
    per_chip = 256 * (4 + 2 * 2) * 64 * 2  # one example of q, k, v a chip, bf16
    assert compiled.memory_analysis().argument_size_in_bytes == per_chip


def test_no_lane_padded_statistics_or_segment_ids():
    """The logsumexp, delta and segment ids travel lane-major (`[.., 1, T]`): the
    compiled fwd+bwd holds no f32 / s32 `[.., T, 1]` array, which the TPU would pad to
    128 lanes."""
    T = 1024
    text = compile_attention("v5e:2x2", T=T, S=T, N=4, K=2, H=128, dtype=jnp.bfloat16,
                             mask_name="causal&segments",
                             block_sizes=BlockSizes(*(512,) * 6)).as_text()
    column = re.compile(rf"(f32|s32)\[[0-9,]*{T},1\]")
    assert "tpu_custom_call" in text and not column.search(text), column.findall(text)


def test_an_attention_layer_feeds_the_kernels_without_relayout_copies(bench_attention):
    """The kernels read `[B, N, T, H]`; a layer produces `[B, T, N, H]`. In a compiled
    layer (projections, RoPE, the Mosaic kernels, output projection; fwd+bwd) XLA's
    layout assignment makes the producers write heads-major and the gradients' consumers
    read it (the transposes become bitcasts), so no q/k/v/dO-sized copy or transpose
    remains around the calls. (The per-call relayout of the op benchmarks, whose q/k/v
    are the program's row-major arguments, does not occur inside a model: that case is
    the check's positive control.)"""
    from flax import nnx

    from tfjax.config import AttentionConfig
    from tfjax.nn.attention import MultiHeadAttention
    from tfjax.nn.positions import RotaryEmbedding

    mesh = _mesh("v5e:2x2")
    T, D, N, K, H = 1024, 256, 4, 2, 128
    layer = MultiHeadAttention(D, N, num_kv_heads=K, head_dim=H,
                               attention=AttentionConfig(impl="pallas"), rope=RotaryEmbedding(H),
                               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)

    def local(params, x):
        def loss(params, x):
            y = nnx.merge(graphdef, params)(x, mask=M.causal())
            return jnp.square(y.astype(jnp.float32)).sum()  # the forward's output is used
        return jax.grad(loss, (0, 1))(params, x)

    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                          params)
    x = jax.ShapeDtypeStruct((mesh.devices.size, T, D), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data")))
    step = jax.jit(_shard_map(local, mesh, (P(), P("data")), (P(), P("data"))))
    text = step.lower(params, x).compile().as_text()
    assert text.count("tpu_custom_call") >= 3  # fwd, dq, dk/dv
    relayouts = bench_attention.relayouts
    found = relayouts(text, T * K * H, T)
    assert not found, found
    bare = compile_attention("v5e:2x2", T=T, S=T, N=N, K=K, H=H, dtype=jnp.bfloat16,
                             mask_name="causal").as_text()
    assert len(relayouts(bare, T * K * H, T)) >= 3  # q, k, v in (and dq, dk, dv out)


@pytest.mark.parametrize("keys_on_lanes", [None, False])
def test_a_decode_step_reads_a_narrow_cache_where_it_lies(keys_on_lanes, bench_attention):
    """At head dim 64 the TPU keeps a program's `[B, K, S, 64]` arguments with S on the
    lanes (no padding of 64 to 128 lanes). An undifferentiated call reads K/V tiles
    with the keys on lanes below head dim 128 (`keys_on_lanes=None`), so a decode step
    whose cache crosses the jit boundary (`tfjax.inference.stream`) relays none of it
    out; the row tiles (`keys_on_lanes=False`, the positive control) relay K and V."""
    mesh = _mesh("v5e:2x2")
    S, N, K, H = 8192, 8, 2, 64

    def local(q, k_cache, v_cache, lengths):  # the caches heads-major, as KVCache stores
        slots = lambda c: c.transpose(0, 2, 1, 3)  # tfjax.nn.state.slots_major
        return flash_attention_tpu(q, slots(k_cache), slots(v_cache), M.padding(lengths),
                                   interpret=False, keys_on_lanes=keys_on_lanes)

    rows = NamedSharding(mesh, P("data"))
    B = mesh.devices.size
    args = (jax.ShapeDtypeStruct((B, 1, N, H), jnp.bfloat16, sharding=rows),
            *[jax.ShapeDtypeStruct((B, K, S, H), jnp.bfloat16, sharding=rows)] * 2,
            jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rows))
    step = jax.jit(_shard_map(local, mesh, (P("data"),) * 4, P("data")))
    text = step.lower(*args).compile().as_text()
    assert text.count("tpu_custom_call") == 1
    found = bench_attention.relayouts(text, S * K * H, S)
    if keys_on_lanes is None:
        assert not found, found
    else:
        assert len(found) >= 2, found  # K and V relaid out for the row tiles
