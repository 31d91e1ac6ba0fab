"""Ring attention and the all-gather baseline on simulated CPU devices: forward and
gradients against the single-device reference, the per-block implementation, zig-zag
balanced and zig-zag ordered inputs, skipped blocks, and the collectives and memory
of the compiled program."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks
from tfjax.ops import RelativeBias
from tfjax.ops.reference import attention_reference
from tfjax.ops.pallas import BlockSizes
from tfjax.parallel import mask_leaves
from tfjax.parallel.ring_attention import all_gather_attention, ring_attention
from tfjax.parallel.zigzag import unzigzag, zigzag
from tfjax.train.aot import xla_cost

B, T, N, K, H = 2, 64, 8, 2, 16  # GQA 8/2


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def mesh4():
    return _mesh((4,), ("sequence",))


@pytest.fixture(scope="module")
def mesh2x4():
    return _mesh((2, 4), ("data", "sequence"))


def _inputs(seed=0, kv_heads=K, Hv=H):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, kv_heads, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, kv_heads, Hv), jnp.float32)
    ct = jax.random.normal(ks[3], (B, T, N, Hv), jnp.float32)
    return q, k, v, ct


SINKS = jnp.asarray([3.0, -1.0, 0.5, 0.0, 1.5, -2.0, 0.2, 2.5])  # one per query head


def _segment_ids():
    # Documents of uneven lengths that straddle device and zig-zag chunk borders.
    a = np.repeat([0, 1, 2, 3], [5, 30, 20, 9])
    b = np.repeat([0, 1], [50, 14])
    return jnp.asarray(np.stack([a, b]), jnp.int32)


MASKS = {
    "none": lambda: None,
    "causal": masks.causal,
    "window": lambda: masks.sliding_window(9),
    "segments": lambda: masks.segments(_segment_ids()),
    "segments_causal": lambda: masks.segments(_segment_ids()) & masks.causal(),
    "prefix_lm": lambda: masks.prefix_lm(jnp.asarray([5, 40], jnp.int32)),
}


def _alibi(positions: bool, per_example: bool = False) -> dict:
    """ALiBi arguments: slopes `[N]` (or `[B, N]`), and with `positions` the packed
    documents' positions (restarting at each segment of `_segment_ids`), in steps
    of 3 so that, even within a document, they differ from the index positions."""
    slopes = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32)
    if per_example:
        slopes = jnp.stack([slopes, 0.5 * slopes])
    kw = dict(alibi_slopes=slopes)
    if positions:
        ids = np.asarray(_segment_ids())
        starts = np.maximum.accumulate(np.where(
            np.diff(ids, prepend=-1, axis=1) != 0, np.arange(T)[None], 0), axis=1)
        pos = jnp.asarray(3 * (np.arange(T)[None] - starts), jnp.int32)
        kw["alibi_positions"] = (pos, pos)
    return kw


def _relative(positions: bool) -> dict:
    """T5 bias arguments (`RelativeBias` fields): a random table, bidirectional,
    max distance 10; with `positions` the packed positions of `_alibi`."""
    kw = dict(table=jax.random.normal(jax.random.key(9), (8, N)), bidirectional=True,
              max_distance=10)
    if positions:
        kw["q_positions"] = kw["kv_positions"] = _alibi(True)["alibi_positions"][0]
    return kw


def _rb(relative, table):
    if relative is None:
        return None
    return RelativeBias(**{**relative, "table": table})


def _out_and_grads(attn, *args_and_ct):
    """(out, d args...) of `attn(*args)` for the output cotangent (the last value)."""
    *args, ct = args_and_ct
    out, vjp = jax.vjp(attn, *args)
    return (out,) + vjp(ct)


def _compare(mask, mesh, load_balance, batch_axes=None, kv_heads=K, softcap=None, scale=None,
             alibi=None, relative=None, sinks=None, Hv=H, **kwargs):
    """ring_attention against the reference: out, dq, dk, dv (and T5's dtable, the
    sinks' gradient); v of head dim `Hv`."""
    q, k, v, ct = _inputs(kv_heads=kv_heads, Hv=Hv)
    alibi = alibi or {}
    table = None if relative is None else relative["table"]

    def ring(q, k, v, t, s):
        return ring_attention(q, k, v, mask, mesh=mesh, batch_axes=batch_axes,
                              load_balance=load_balance, block_q=8, block_kv=8,
                              softcap=softcap, scale=scale, relative_bias=_rb(relative, t),
                              sinks=s, **alibi, **kwargs)

    got = jax.jit(lambda *a: _out_and_grads(ring, *a))(q, k, v, table, sinks, ct)
    want = jax.jit(lambda *a: _out_and_grads(
        lambda q, k, v, t, s: attention_reference(q, k, v, mask, softcap=softcap, scale=scale,
                                                  relative_bias=_rb(relative, t), sinks=s,
                                                  **alibi),
        *a))(q, k, v, table, sinks, ct)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, g, w in zip(["q", "k", "v", "table", "sinks"], got[1:], want[1:]):
        if w is not None:
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("mask_name,load_balance", [
    ("none", "none"),
    ("causal", "none"),
    ("causal", "zigzag"),
    ("window", "none"),
    ("segments", "none"),
    ("prefix_lm", "zigzag"),
])
def test_matches_reference(mesh4, mask_name, load_balance):
    # causal zig-zag with T5's bias at index positions (each chunk's global offsets)
    relative = _relative(False) if (mask_name, load_balance) == ("causal", "zigzag") else None
    _compare(MASKS[mask_name](), mesh4, load_balance, relative=relative)


def test_batch_sharded_zigzag_segments_causal(mesh2x4):
    # with ALiBi: per-example slopes (batch-sharded) and the packed documents'
    # positions, re-laid out in zig-zag order and rotated with K/V like segment ids;
    # T5's bias at the same positions (its table's gradient summed over 8 devices)
    _compare(MASKS["segments_causal"](), mesh2x4, "zigzag", batch_axes="data",
             alibi=_alibi(positions=True, per_example=True), relative=_relative(True))


@pytest.mark.parametrize("mask_name,unroll", [("segments_causal", False), ("window", None)])
def test_zigzag_ordered_inputs(mesh4, mask_name, unroll):
    """natural_order=False: inputs (and segment ids, and ALiBi's positions) already in
    zig-zag order, as the trainer's data pipeline gives them; the output and
    gradients come back in that order and, undone, equal the reference on the
    natural-order sequence. The first case runs the ring's steps as a while loop
    (unroll=False, the default off CPU) with ALiBi at the packed positions."""
    q, k, v, ct = _inputs()
    n = 4
    zz = lambda x: zigzag(x, n, axis=1)
    ids = _segment_ids()
    make = {"segments_causal": lambda i: masks.segments(i) & masks.causal(),
            "window": lambda i: masks.sliding_window(9)}[mask_name]
    alibi = _alibi(positions=True) if mask_name == "segments_causal" else {}
    alibi_zz = {k: (tuple(map(zz, a)) if k == "alibi_positions" else a) for k, a in alibi.items()}
    rel = _relative(True) if mask_name == "segments_causal" else None  # T5 too
    rel_zz = rel and {k: zz(a) if k.endswith("positions") else a for k, a in rel.items()}
    table = rel and rel["table"]

    def ring(q, k, v, t):
        return ring_attention(q, k, v, make(zz(ids)), mesh=mesh4, load_balance="zigzag",
                              natural_order=False, block_q=8, block_kv=8, unroll=unroll,
                              relative_bias=_rb(rel_zz, t), **alibi_zz)

    got = jax.jit(lambda *a: _out_and_grads(ring, *a))(zz(q), zz(k), zz(v), table, zz(ct))
    want = _out_and_grads(lambda q, k, v, t: attention_reference(
        q, k, v, make(ids), relative_bias=_rb(rel, t), **alibi), q, k, v, table, ct)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(unzigzag(g, n, axis=1), w, atol=1e-4, rtol=1e-4,
                                   err_msg=name)
    if rel is not None:
        np.testing.assert_allclose(got[4], want[4], atol=1e-4, rtol=1e-4, err_msg="dtable")


def test_pallas_kernels_inside_the_ring(mesh4):
    # The Pallas TPU kernels (interpret mode on CPU) as the per-block attention, fwd+bwd:
    # packed documents, causal, zig-zag (traced per-chunk offsets), GQA 8/2.
    # With ALiBi at index positions: each chunk's global offset reaches the kernels;
    # T5's bias at the packed positions (rotating with K/V), its table's gradient
    # summed over the blocks and the devices. Learned sinks join each row once,
    # after the ring; values of a head dim of their own (8 against 16).
    _compare(MASKS["segments_causal"](), mesh4, "zigzag", implementation="pallas",
             block_sizes=BlockSizes(8, 128, 8, 128, 8, 128), alibi=_alibi(positions=False),
             relative=_relative(True), sinks=SINKS, Hv=8)


def test_sinks_and_value_head_dim_through_the_ring(mesh2x4):
    """Sinks (their gradient summed over the data and sequence devices) and Hv = 24
    with the blockwise blocks, zig-zag, packed documents; the sinks also cover the
    fully masked rows of the reference's "window" rows (none here)."""
    _compare(MASKS["segments_causal"](), mesh2x4, "zigzag", batch_axes="data", sinks=SINKS,
             Hv=24, softcap=5.0)


@pytest.mark.parametrize("implementation,family", [("blockwise", "blockwise"),
                                                    ("pallas", "pallas"), ("auto", "blockwise")])
def test_the_ring_runs_the_block_family_it_is_given(mesh4, monkeypatch, implementation, family):
    """`ring_attention(implementation=)` runs the per-block attention
    `tfjax.ops.attention.select_ring_block` chose, forward and backward, and nothing
    else: "blockwise" the blockwise functions, "pallas" the Pallas TPU kernels
    (interpret mode on this CPU mesh), "auto" blockwise on a CPU mesh (traced only)."""
    import tfjax.ops.blockwise as blockwise_lib
    import tfjax.ops.pallas.mosaic_tpu as tpu_lib

    calls = collections.Counter()

    def spy(module, name, kind):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.update([kind]) or real(*a, **kw))

    spy(blockwise_lib, "blockwise_attention", ("blockwise", "forward"))
    spy(blockwise_lib, "blockwise_attention_backward", ("blockwise", "backward"))
    spy(tpu_lib, "flash_attention_tpu", ("pallas", "forward"))
    spy(tpu_lib, "flash_attention_tpu_backward", ("pallas", "backward"))
    q, k, v, _ = _inputs()
    loss = lambda q, k, v: ring_attention(
        q, k, v, masks.causal(), mesh=mesh4, block_q=16, block_kv=16,
        block_sizes=BlockSizes(8, 128, 8, 128, 8, 128),
        implementation=implementation).sum()
    jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v)
    assert set(calls) == {(family, "forward"), (family, "backward")}, calls


def _all_gather_matches_reference(mesh, **kwargs):
    """all_gather_attention (`kwargs`) against the reference: packed documents,
    causal, ALiBi's and T5's explicit positions (the kv ones gathered with K/V), T5's
    table (its gradient summed over the devices); out, dq, dk, dv, dtable. Returns
    the gathered attention and its q, k, v."""
    mask = MASKS["segments_causal"]()
    sinks = kwargs.pop("sinks", None)
    q, k, v, ct = _inputs(Hv=kwargs.pop("Hv", H))
    alibi, rel = _alibi(positions=True), _relative(True)

    def gathered(q, k, v, t=rel["table"], s=sinks):
        return all_gather_attention(q, k, v, mask, mesh=mesh, batch_axes="data",
                                    relative_bias=_rb(rel, t), sinks=s, **alibi, **kwargs)

    got = jax.jit(lambda *a: _out_and_grads(gathered, *a))(q, k, v, rel["table"], sinks, ct)
    want = jax.jit(lambda *a: _out_and_grads(
        lambda q, k, v, t, s: attention_reference(q, k, v, mask, relative_bias=_rb(rel, t),
                                                  sinks=s, **alibi),
        *a))(q, k, v, rel["table"], sinks, ct)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, g, w in zip(["q", "k", "v", "table", "sinks"], got[1:], want[1:]):
        if w is not None:
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
    return gathered, (q, k, v)


@pytest.mark.xla_optimized  # the compiled HLO is checked too
def test_all_gather_attention_matches_reference(mesh2x4):
    gathered, args = _all_gather_matches_reference(mesh2x4, block_q=8, block_kv=8, sinks=SINKS,
                                                   Hv=8)
    hlo = jax.jit(gathered).lower(*args).compile().as_text()
    assert "all-gather" in hlo and "collective-permute" not in hlo


def test_all_gather_attention_runs_an_explicit_implementation_per_device(mesh2x4):
    """implementation="xla" per device through `dot_product_attention`, at each
    device's global query offset (the dispatch materialises the mask, ALiBi and T5's
    bias for xla at that traced offset)."""
    _all_gather_matches_reference(mesh2x4, implementation="xla")


def test_softcap_through_the_ring(mesh4):
    # A large scale makes the soft-cap (tanh) bite on most logits, forward and backward.
    _compare(masks.causal(), mesh4, "zigzag", softcap=2.0, scale=1.0)


def test_fully_masked_rows_are_zero(mesh4):
    # Query 0 of example 1 is in a document with no keys visible under the mask below.
    q, k, v, _ = _inputs()
    ids = jnp.asarray(np.stack([np.zeros(T), np.r_[1, np.zeros(T - 1)]]), jnp.int32)
    mask = masks.segments(ids, jnp.zeros_like(ids))
    out = jax.jit(lambda q, k, v: ring_attention(q, k, v, mask, mesh=mesh4))(q, k, v)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1, 0], 0.0)
    np.testing.assert_allclose(out, attention_reference(q, k, v, mask), atol=1e-5)


def test_masked_blocks_are_skipped_and_zigzag_balances(mesh4, monkeypatch):
    """Count the blockwise calls each device really runs (skipped steps run none)."""
    import tfjax.ops.blockwise as blockwise_lib

    counts = collections.Counter()
    inner = blockwise_lib.blockwise_attention

    def counting(*args, **kwargs):
        jax.debug.callback(lambda d: counts.update([int(d)]), lax.axis_index("sequence"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(blockwise_lib, "blockwise_attention", counting)
    q, k = jnp.ones((1, 32, 2, 8)), jnp.ones((1, 32, 1, 8))
    per_device = {}
    for lb in ("none", "zigzag"):
        counts.clear()
        jax.jit(lambda q, k, lb=lb: ring_attention(q, k, k, masks.causal(), mesh=mesh4,
                                                   load_balance=lb))(q, k).block_until_ready()
        jax.effects_barrier()
        per_device[lb] = [counts[i] for i in range(4)]
    assert per_device["none"] == [1, 2, 3, 4]  # device i: blocks 0..i, the rest skipped
    # 2n x 2n half-size sub-blocks; the causal ones, spread evenly: (2n)(2n+1)/2 / n each.
    assert per_device["zigzag"] == [9, 9, 9, 9]


@pytest.mark.xla_optimized  # compiled HLO
@pytest.mark.parametrize("load_balance,natural_order", [("none", True), ("zigzag", True)])
def test_hlo_ring_has_no_all_gather(mesh4, load_balance, natural_order):
    """Forward and backward: K/V move only by collective-permutes, also when
    natural-order inputs are re-laid out to zig-zag and back."""
    q, k, v, ct = _inputs()

    def ring(q, k, v):
        return ring_attention(q, k, v, masks.causal(), mesh=mesh4, load_balance=load_balance,
                              natural_order=natural_order, block_q=16, block_kv=16)

    hlo = jax.jit(lambda *a: _out_and_grads(ring, *a)).lower(q, k, v, ct).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo
    assert "all-to-all" not in hlo


def test_bad_arguments(mesh4):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="load_balance"):
        ring_attention(q, k, v, mesh=mesh4, load_balance="striped")
    with pytest.raises(ValueError, match="implementation must be one of"):
        ring_attention(q, k, v, mesh=mesh4, implementation="cudnn")

    with pytest.raises(ValueError, match="divisible"):
        ring_attention(q[:, :62], k[:, :62], v[:, :62], mesh=mesh4)
    short = masks.segments(np.zeros((B, T - 4), np.int32), np.zeros((B, T), np.int32))
    for attend in (ring_attention, all_gather_attention):
        with pytest.raises(ValueError, match=rf"q_segment_ids has length {T - 4} but the queries"):
            attend(q, k, v, short, mesh=mesh4)


@pytest.mark.xla_optimized  # compiled memory
def test_per_device_memory_is_flat_and_below_single_device():
    """Compiled per-device temporaries of causal fwd+bwd (zig-zag, while loop): flat
    from 4 to 8 devices at 256 tokens per device; at one total length (2048) 8
    devices hold about half of what 4 do (measured 0.53x with jax 0.10 / 0.11,
    0.61x with 0.12: a fixed per-step part does not shrink) and less than
    single-device blockwise (0.36x with jax 0.10 / 0.11; 0.80x with 0.12, whose XLA
    holds single-device blockwise in half the memory it did but not the ring's
    loop; the issue's 1/6 is out of reach by construction, see
    experiments/results/ring_attention.md)."""
    from tfjax.ops.blockwise import blockwise_attention

    blk = 128

    def temp(n, tpd=256):
        sh = None
        if n:
            mesh = _mesh((n,), ("sequence",))
            sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
            attn = lambda q, k, v: ring_attention(q, k, v, masks.causal(), mesh=mesh,
                                                  load_balance="zigzag", natural_order=False,
                                                  block_q=blk, block_kv=blk, unroll=False)
        else:
            attn = lambda q, k, v: blockwise_attention(q, k, v, masks.causal(), block_q=blk,
                                                       block_kv=blk)
        S = (n or 8) * tpd
        args = [jax.ShapeDtypeStruct((1, S, h, 64), jnp.float32, sharding=sh) for h in (4, 1, 1)]
        grad = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    ring4, ring8, single = temp(4), temp(8), temp(0)
    assert ring8 <= 1.02 * ring4, (ring4, ring8)
    ring4_same_length = temp(4, tpd=512)
    assert ring8 <= 0.7 * ring4_same_length, (ring8, ring4_same_length)
    assert ring8 <= 0.9 * single, (ring8, single)


def test_batch_axes_are_inferred_not_gathered(mesh2x4):
    """Without batch_axes, a data x sequence mesh splits the batch over "data" (as if
    named) instead of every data shard computing the whole batch; () replicates."""
    q, k, v, _ = _inputs()

    def flops(**kw):
        fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, masks.causal(), mesh=mesh2x4,
                                                    block_q=8, block_kv=8, **kw))
        return xla_cost(fn.lower(q, k, v).compile())["flops"]

    inferred, named, replicated = flops(), flops(batch_axes="data"), flops(batch_axes=())
    assert inferred == named
    assert replicated > 1.5 * named
    with pytest.raises(ValueError, match="include the sequence axis"):
        ring_attention(q, k, v, mesh=mesh2x4, batch_axes=("data", "sequence"))


def test_infer_batch_axes(mesh2x4):
    from jax.sharding import NamedSharding
    x = jnp.zeros((B, T, N, H))
    # a committed array: the axes its batch dim is split over
    split = jax.device_put(x, NamedSharding(mesh2x4, P("data", "sequence")))
    assert mask_leaves.infer_batch_axes(split, mesh2x4, "sequence") == ("data",)
    whole = jax.device_put(x, NamedSharding(mesh2x4, P(None, "sequence")))
    assert mask_leaves.infer_batch_axes(whole, mesh2x4, "sequence") == ()
    # not committed to this mesh: tfjax's batch rule's axes in the mesh
    assert mask_leaves.infer_batch_axes(x, mesh2x4, "sequence") == ("data",)
    assert mask_leaves.infer_batch_axes(x[:1], mesh2x4, "sequence") == ()  # 1 % 2
    foreign = _mesh((2, 4), ("dp", "sp"))  # a mesh without tfjax's names: all but seq
    assert mask_leaves.infer_batch_axes(x, foreign, "sp") == ("dp",)
