"""The suite every attention implementation inherits: against the materialising
reference, forward, logsumexp and every gradient (dq, dk, dv, dbias, T5's table),
on shapes that are no multiple of any tile, GQA and MQA, every mask kind and
their combinations with offsets, fully masked rows, soft-cap, bias, ALiBi, T5's
bias, learned sinks (added as the dispatch adds them, and their gradient), a
value head dim of its own (`Hv`), bf16 (`attention_cases.check_against_reference`,
one jit per case).

The suite is driven by the implementation table, `tfjax.ops.attention.IMPLEMENTATIONS`:
every implementation in it runs every case of `SHARED`, and a case it cannot serve
is skipped with the reason its own `supports()` gives (`attention_cases.refusal`).
`SETTINGS`, keyed by the table's names, says how the suite runs an implementation;
a name without settings is called through `dot_product_attention(implementation=
name)` on this host, so an implementation inherits the shared cases by joining the
table. A setting holds:

- the function it calls (with `flash_attention`'s signature) and the suite's tiles
  for it: small enough that tails, skipped tiles and multi-tile rows occur;
- the platform its request is made for (`supports()` sees it): "pallas" runs as
  the Mosaic TPU kernels in interpret mode here ("mosaic_tpu"), and also, as on a
  GPU, the Triton kernels ("triton") and the Mosaic GPU kernels ("mosaic_gpu",
  16-bit only, whose pinned kernels also answer through the family's `plan`), both
  in Pallas' GPU interpret mode;
- cases of its own: what exercises its tiles, its plan's options (decode packing,
  key splits) and its kernel configurations, kept to it because interpret mode
  compiles slowly on CPU.

Each (implementation, setting, case) compiles once. The properties after
`test_matches_reference` (fully masked rows, the dispatch, traced offsets,
determinism, ALiBi and T5's bias as parameters) also run on every implementation
of the table, with each test's own tiles. Implementation-specific
behaviour (plans, launch tables, lowering, refusals) is tested beside each
implementation's module: test_blockwise.py, test_pallas.py, test_mosaic_tpu.py,
test_triton.py, test_mosaic_gpu.py."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, make_mask, refusal, request

from tfjax.ops import IMPLEMENTATIONS, attention_reference, blockwise_attention
from tfjax.ops import dot_product_attention
from tfjax.ops import masks as M
from tfjax.ops.pallas import BlockSizes, flash_attention, flash_attention_gpu, plan
from tfjax.ops.pallas.mosaic_gpu import HopperConfig as HC
from tfjax.ops.pallas.mosaic_gpu_backward import HopperBackwardConfig as HB

# The suite's tiles: small enough that tails, skipped tiles and multi-tile rows occur.
BS_TPU = BlockSizes(block_q=64, block_kv=128, block_q_dq=64, block_kv_dq=128, block_q_dkv=128,
                    block_kv_dkv=128)
# dq's kv tile spans 256 lanes (T5's per-bucket sums fold two lane tiles)
BS_TPU_WIDE_DQ = BlockSizes(block_q=64, block_kv=128, block_q_dq=64, block_kv_dq=256,
                            block_q_dkv=128, block_kv_dkv=128)
BS_GPU = BlockSizes(32, 64, 32, 64, 64, 32)

# What a case's call computes (the rest of its keywords are its implementation's options).
SEMANTICS = ("dtype", "Hv", "bias", "softcap", "q_offset", "kv_offset", "alibi", "relative",
             "sinks", "primal")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call checked against the reference: sizes, a mask by name
    (`attention_cases.make_mask`), what it computes (`extras`: `SEMANTICS`) and how
    its implementation runs it (`options`: tiles, plan options, kernel configs)."""

    name: str
    B: int
    T: int
    S: int
    heads: tuple[int, int]
    H: int
    mask: str
    extras: dict
    options: dict
    slow: bool = False

    def abstract_call(self, backend: str | None):
        """(q, k, v as ShapeDtypeStructs, the request `supports()` judges on `backend`);
        the suite always asks for the logsumexp."""
        x = self.extras
        dtype = x.get("dtype", jnp.float32)
        N, K = self.heads
        sds = jax.ShapeDtypeStruct
        q, k = sds((self.B, self.T, N, self.H), dtype), sds((self.B, self.S, K, self.H), dtype)
        v = sds((self.B, self.S, K, x.get("Hv") or self.H), dtype)
        return q, k, v, request(
            q, k, v, make_mask(self.mask, self.B, self.T, self.S), backend=backend,
            bias=x.get("bias") is not None, softcap=x.get("softcap"),
            offsets=bool(x.get("q_offset") or x.get("kv_offset")), return_lse=True,
            alibi=x.get("alibi") is not None, relative=x.get("relative") is not None,
            sinks=bool(x.get("sinks")))


def case(B, T, S, heads, H, mask, *, name=None, slow=False, **keywords) -> Case:
    """A `Case`; `keywords` are split into its extras (`SEMANTICS`) and options. Its
    default name: its sizes, mask, `Hv`, sinks and a bf16 dtype."""
    extras = {k: v for k, v in keywords.items() if k in SEMANTICS}
    options = {k: v for k, v in keywords.items() if k not in SEMANTICS}
    if name is None:
        name = f"T{T}-S{S}-NK{heads[0]}x{heads[1]}-H{H}-{mask}"
        name += f"-Hv{extras['Hv']}" if extras.get("Hv") else ""
        name += "-sinks" if extras.get("sinks") else ""
        name += "-bf16" if extras.get("dtype") == jnp.bfloat16 else ""
    return Case(name, B, T, S, heads, H, mask, extras, options, slow)


def mosaic_gpu(B, T, S, heads, H, mask, name, forward, backward, **extras) -> Case:
    """A Mosaic GPU case: `forward` its HopperConfig, `backward` its
    HopperBackwardConfig or None (the Triton backward from its residuals)."""
    return case(B, T, S, heads, H, mask, name=name, dtype=jnp.bfloat16, hopper_config=forward,
                backward="triton" if backward is None else "hopper",
                hopper_backward_config=backward, **extras)


# Every implementation runs these: GQA / MQA with every per-tile extra and offsets,
# fully masked rows, a KV cache's mask, sinks with a value head dim of their own.
SHARED = (
    case(2, 1, 1, (4, 4), 32, "none"),
    case(2, 100, 200, (8, 2), 80, "causal&segments", name="gqa-segments-softcap-bias-alibi-t5-tails",
         softcap=20.0, q_offset=3, bias=(1, 8), alibi="N", relative="causal"),  # far tiles
    case(2, 128, 100, (4, 1), 32, "padding_fully_masked", name="mqa-fully-masked-rows-alibi-t5",
         kv_offset=2, alibi="BN", relative="coarse"),
    case(2, 70, 200, (4, 2), 32, "positions_window", name="kv-cache-positions-window"),
    case(2, 100, 130, (4, 2), 48, "window&segments", name="sinks-hv24-softcap-bias", Hv=24,
         sinks=True, softcap=10.0, bias=(2, 1)),
)

# blockwise: tiles of 128 so tails, skipped tiles and multi-tile rows all occur
BLOCKWISE = (
    case(2, 1, 1000, (8, 1), 64, "causal", q_offset=999),  # the last token
    case(2, 100, 100, (8, 2), 80, "causal", softcap=20.0, relative="causal"),
    case(2, 384, 128, (4, 4), 128, "chunked", q_offset=60, relative="bidir"),
    case(2, 1000, 1000, (8, 2), 32, "causal&segments", alibi="N"),
    case(2, 100, 1000, (8, 1), 64, "prefix", bias=(1, 8), relative="pos"),
    case(2, 384, 384, (4, 4), 32, "window&segments", softcap=5.0, bias=(2, 1)),
    case(2, 128, 100, (8, 2), 32, "padding_fully_masked", bias=(2, 8), relative="bidir"),
    case(2, 384, 1000, (8, 2), 128, "prefix|window", q_offset=3, kv_offset=7, alibi="BN"),
    case(2, 128, 384, (8, 1), 64, "window_lr", alibi="pos"),
    case(2, 100, 300, (4, 2), 32, "positions_window"),  # a chunked prefill
    # B = 1: the training forward and the backward call the example directly (no vmap)
    case(1, 100, 300, (4, 2), 32, "causal&segments", bias=(1, 4), softcap=5.0, alibi="N",
         relative="pos"),
    case(2, 384, 384, (8, 2), 64, "causal", dtype=jnp.bfloat16),
    # learned sinks with every mask kind and a soft-cap (32 x 32 tiles), values of
    # their own head dim; fully masked rows with sinks stay zero
    *[case(2, 70, 90, (4, 2), 16, mask, sinks=True, softcap=5.0,
           Hv=24 if mask in ("causal", "bigbird", "prefix") else None, block_q=32, block_kv=32)
      for mask in ("none", "causal", "window_lr", "chunked", "prefix", "causal&segments",
                   "padding_fully_masked", "longformer&causal", "bigbird", "positions_window",
                   "prefix|window", "windowed(prefix)", "windowed(causal|blocks)")],
    case(2, 100, 100, (8, 1), 32, "causal&segments", Hv=16, alibi="N", relative="pos",
         bias=(1, 8)),
    # a sweep (slow): masks by heads (32 x 64 tiles) with a broadcast bias and a soft-cap
    *[case(2, 100, 128, heads, 32, mask, slow=True, bias=(1, 1), softcap=10.0, block_q=32,
           block_kv=64)
      for mask, heads in (("window", (4, 4)), ("chunked", (8, 1)), ("segments", (8, 2)),
                          ("causal&segments", (8, 1)), ("padding_fully_masked", (4, 4)))],
)

# mosaic_tpu: every mask kind in a kernel (iota masks, segment tiles, per-example
# scalars), head dims padded to 128 lanes, T5's bias at index and explicit positions;
# `primal`: also the undifferentiated forward, which reads K/V with the keys on lanes
# below head dim 128 (tails, GQA, Hv != H, packed and split decode)
MOSAIC_TPU = (
    case(2, 100, 200, (8, 2), 80, "causal&segments", softcap=20.0, q_offset=3, alibi="BN",
         relative="causal", primal=True),
    case(2, 384, 128, (8, 1), 64, "window_lr", bias=(1, 8), alibi="pos", relative="pos",
         primal=True),
    case(2, 128, 100, (4, 4), 128, "padding_fully_masked", bias=(2, 1), relative="bidir"),
    case(1, 1000, 1000, (4, 4), 32, "chunked", relative="causal", block_sizes=BS_TPU_WIDE_DQ),
    # T5's bias (max distance 24) on whole 384 x 384 grids: at explicit positions
    # index // 12 (bidirectional) tiles far in index hold several buckets; at index
    # positions (unidirectional) far tiles hold one (the past's last, or 0)
    case(2, 384, 384, (4, 2), 32, "none", relative="coarse"),
    case(2, 384, 384, (4, 1), 32, "none", relative="causal", kv_offset=9),
    case(2, 100, 384, (8, 2), 32, "prefix|window", kv_offset=5, alibi="N", relative="bidir"),
    case(2, 200, 300, (8, 2), 64, "bigbird", kv_offset=5),
    case(2, 100, 100, (4, 2), 32, "windowed(prefix)", q_offset=2, kv_offset=2),
    case(2, 100, 100, (4, 2), 32, "windowed(causal|blocks)"),
    case(2, 130, 130, (4, 1), 32, "longformer&causal", q_offset=3, softcap=30.0),
    # a KV cache's masks: chunked prefill over [cache; fresh keys], and decode
    case(2, 100, 300, (8, 2), 64, "positions_window", softcap=10.0, primal=True),
    case(2, 1, 300, (8, 1), 32, "positions", alibi="N"),
    # decode and speculative steps: query heads packed, keys split into chunks
    # (decode.py; chunks of 100, 65, 75 and 40 keys: never whole tiles)
    case(2, 1, 300, (8, 2), 64, "positions", softcap=10.0, pack_heads=True, kv_splits=3,
         primal=True),
    case(2, 5, 200, (4, 1), 32, "positions_window", bias=(2, 4), pack_heads=True),
    case(2, 3, 130, (4, 2), 32, "positions", bias=(1, 1), pack_heads=True, kv_splits=2),
    case(2, 2, 300, (4, 2), 32, "padding_fully_masked", kv_splits=4, kv_offset=7),
    case(2, 4, 200, (8, 2), 32, "segments", kv_splits=5, alibi="pos", bias=(1, 8)),
    case(1, 256, 256, (8, 2), 64, "causal", dtype=jnp.bfloat16),
    # sinks and Hv != H (padded to one lane width with H); decode packed and split
    # with sinks (added once, after the chunks merge)
    case(2, 100, 200, (4, 2), 48, "causal&segments", Hv=32, sinks=True, softcap=10.0,
         q_offset=3, alibi="BN", primal=True),
    case(2, 130, 130, (4, 1), 32, "padding_fully_masked", Hv=136, sinks=True, relative="bidir"),
    case(2, 1, 300, (8, 2), 64, "positions", Hv=40, sinks=True, pack_heads=True, kv_splits=3,
         primal=True),
    # a sweep (slow): masks by head dim with a broadcast bias and a soft-cap
    *[case(1, 130, 260, (8, 1), H, mask, slow=True, bias=(1, 1), softcap=10.0)
      for mask, H in (("causal", 256), ("window", 64), ("segments", 256),
                      ("window&segments", 64))],
)

# triton: ALiBi and T5's bias at explicit positions, sinks with ALiBi
TRITON = (
    case(2, 100, 130, (4, 2), 32, "causal&segments", name="alibi-t5-positions-segments",
         alibi="pos", relative="pos"),
    case(2, 70, 90, (4, 4), 16, "padding_fully_masked", name="sinks-hv40-alibi", Hv=40,
         sinks=True, alibi="pos"),
)

# mosaic_gpu: two consumer warpgroups and a producer (warp specialisation, the
# default) take turns on the tensor cores (ping-pong) unless pingpong=False or
# overlap=True (each overlaps its own softmax with its P V matmul);
# compute_warpgroups=1: one warpgroup issues its own copies. ALiBi: explicit
# positions (copied like segment ids) under the overlap schedule and a
# one-warpgroup backward, and with the Triton backward (head dim 256); index
# positions with per-example slopes and offsets under ping-pong.
MOSAIC_GPU = (
    mosaic_gpu(1, 100, 150, (4, 2), 80, "causal&segments",
               "gqa-segments-softcap-offset-tails-h80-pingpong", HC(block_kv=64), HB(),
               softcap=2.0, q_offset=3),
    mosaic_gpu(2, 128, 300, (4, 1), 64, "padding_fully_masked",
               "mqa-fully-masked-rows-alibi-positions-one-warpgroup-overlap",
               HC(block_kv=64, compute_warpgroups=1, overlap=True),
               HB(compute_warpgroups=1, stages=1), kv_offset=2, alibi="pos"),
    mosaic_gpu(1, 200, 200, (2, 2), 128, "window_lr",
               "window-mha-h128-no-pingpong-blocks128-lpt-order",
               HC(block_kv=64, pingpong=False, order="lpt"), HB(128, 128)),
    mosaic_gpu(1, 70, 90, (2, 1), 256, "prefix",
               "prefix-h256-overlap-alibi-positions-triton-backward",
               HC(block_kv=64, overlap=True), None, alibi="pos"),
    mosaic_gpu(2, 140, 150, (2, 1), 64, "causal", "causal-alibi-offsets-pingpong-two-query-tiles",
               HC(block_kv=64), HB(), alibi="BN", q_offset=30, kv_offset=5),
    mosaic_gpu(1, 70, 150, (2, 1), 64, "positions_window", "kv-cache-positions-window-h64",
               HC(block_kv=64), HB()),
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """How the suite runs one implementation of the table (see the module docstring)."""

    fn: Callable  # `flash_attention`'s signature
    options: dict  # the suite's tiles (a case's options override them)
    backend: str | None = None  # the platform of its request; None: this host's
    cases: tuple[Case, ...] = ()  # its own, beside `SHARED`
    # a kernel family's plan arguments that pin its kernels (`tfjax.ops.pallas.plan`):
    # a request the pinned kernels cannot run is refused with the plan's reason
    pinned: dict | None = None

    def refusal(self, name: str, c: Case) -> str | None:
        q, k, v, req = c.abstract_call(self.backend)
        reason = refusal(name, req)
        if reason is None and self.pinned is not None:
            x, opts = c.extras, {**self.options, **c.options}
            try:
                # the kernel choice reads whether there is a bias or T5's bias, not its values
                plan(q, k, v, req.mask, bias=x.get("bias"), relative_bias=x.get("relative"),
                     **{**self.pinned, "backward": opts["backward"]})
            except ValueError as e:
                reason = f"{name}: {e}"
        return reason


# table name -> {setting name ("" for the only one): Setting}
SETTINGS: dict[str, dict[str, Setting]] = {
    "blockwise": {"": Setting(blockwise_attention, dict(block_q=128, block_kv=128),
                              cases=BLOCKWISE)},
    "pallas": {
        "mosaic_tpu": Setting(flash_attention, dict(block_sizes=BS_TPU), cases=MOSAIC_TPU),
        "triton": Setting(functools.partial(flash_attention_gpu, interpret=True),
                          dict(block_sizes=BS_GPU), backend="gpu", cases=TRITON),
        "mosaic_gpu": Setting(
            functools.partial(flash_attention_gpu, interpret=True, forward="hopper"),
            dict(block_sizes=BS_GPU, backward="hopper"), backend="gpu", cases=MOSAIC_GPU,
            pinned=dict(kernels="triton", interpret=True, forward="hopper", pack_heads=False,
                        kv_splits=1)),
    },
}


def settings(name: str) -> dict[str, Setting]:
    """An implementation's settings; without any, the dispatch on this host."""
    if name in SETTINGS:
        return SETTINGS[name]
    return {"": Setting(functools.partial(dot_product_attention, implementation=name), {})}


def _params():
    assert set(SETTINGS) <= set(IMPLEMENTATIONS), "SETTINGS names an implementation not in " \
                                                  "the table"
    out = []
    for name in IMPLEMENTATIONS:
        for label, setting in settings(name).items():
            cases = SHARED + setting.cases
            assert len({c.name for c in cases}) == len(cases), f"{name} {label}: a case twice"
            for c in cases:
                where = f"{name}-{label}" if label else name
                out.append(pytest.param(name, label, c, id=f"{where}-{c.name}",
                                        marks=(pytest.mark.slow,) if c.slow else ()))
    return out


@pytest.mark.parametrize("name,label,c", _params())
def test_matches_reference(name, label, c):
    setting = settings(name)[label]
    reason = setting.refusal(name, c)
    if reason:
        pytest.skip(reason)
    extras = {**setting.options, **c.options, **c.extras}
    dtype = extras.pop("dtype", jnp.float32)
    Hv = extras.pop("Hv", None)
    if dtype == jnp.bfloat16 and name == "blockwise":
        # the bf16 tolerance holds under the CPU suite's fast compile (tests/conftest.py)
        assert jax.config.values["jax_disable_most_optimizations"] or jax.default_backend() != "cpu"
    q, k, v, bias = inputs(c.B, c.T, c.S, *c.heads, c.H, dtype=dtype, bias=extras.pop("bias", None),
                           Hv=Hv)
    check_against_reference(setting.fn, q, k, v, make_mask(c.mask, c.B, c.T, c.S), bias, **extras)


# --------------------------------------------------------------------------- #
# Properties every implementation of the table keeps, each called as the test
# needs: with the test's tiles (keyed by the table's names) where it gives them,
# else through `dot_product_attention`; a call an implementation cannot serve is
# skipped with its `supports()` reason.
# --------------------------------------------------------------------------- #

# the functions that take an implementation's tile options (the dispatch calls them
# with their defaults)
TILED = {"blockwise": blockwise_attention, "pallas": flash_attention}
ORACLE = "reference"  # what dispatched results are compared with (not with itself)


def attention_fn(name: str, tiles: dict[str, dict]) -> Callable:
    """Implementation `name` with `flash_attention`'s signature: its own function with
    `tiles[name]`, or, without tiles for it, the dispatch."""
    if name in tiles:
        return functools.partial(TILED[name], **tiles[name])
    return functools.partial(dot_product_attention, implementation=name)


def skip_unless_served(name: str, req) -> None:
    reason = refusal(name, req)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("name", IMPLEMENTATIONS.names())
def test_fully_masked_rows_are_zero_with_zero_grads(name):
    """Example 0 sees no key: its output, its logsumexp's exp and its dq are 0, every
    gradient is finite (an implementation that returns no logsumexp, xla, is checked
    without it)."""
    q, k, v, _ = inputs(2, 100, 100, 4, 4, 32)
    mask = M.padding(np.array([0, 50]))
    skip_unless_served(name, request(q, k, v, mask))
    with_lse = refusal(name, request(q, k, v, mask, return_lse=True)) is None
    attend = attention_fn(name, {"blockwise": dict(block_q=32, block_kv=32),
                                 "pallas": dict(block_sizes=BS_TPU)})
    f = lambda q, k, v: attend(q, k, v, mask).sum()
    if not with_lse:
        out = jax.jit(lambda q, k, v: attend(q, k, v, mask))(q, k, v)
    else:
        out, lse = jax.jit(lambda q, k, v: attend(q, k, v, mask, return_lse=True))(q, k, v)
        assert np.isneginf(np.asarray(lse[0])).all()
    assert (np.asarray(out[0]) == 0).all() and np.isfinite(np.asarray(out)).all()
    grads = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert (np.asarray(grads[0][0]) == 0).all()


@pytest.mark.parametrize("mask_name", ["none", "segments&causal", "fully_masked_rows", "window"])
@pytest.mark.parametrize("name", [n for n in IMPLEMENTATIONS.names() if n != ORACLE])
def test_dispatched_matches_reference_forward_and_grads(name, mask_name):
    """Through `dot_product_attention`: out and the gradients of q, k, v and a bias
    equal the reference's on a tiny GQA problem (6 query heads on 2)."""
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3]])
    mask = {"none": None, "segments&causal": M.segments(seg) & M.causal(),
            "fully_masked_rows": M.padding(np.array([0, 3])),
            "window": M.sliding_window(2)}[mask_name]
    rand = lambda shape, seed: jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    q, k, v = rand((2, 7, 6, 16), 7), rand((2, 7, 2, 16), 8), rand((2, 7, 2, 16), 9)
    bias = 0.1 * rand((1, 6, 7, 7), 10)
    skip_unless_served(name, request(q, k, v, mask, bias=True))

    def loss(impl, q, k, v, bias):
        out = dot_product_attention(q, k, v, mask, bias=bias, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    (_, out_r), g_r = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
        ORACLE, q, k, v, bias)
    (_, out_x), g_x = jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True)(
        name, q, k, v, bias)
    np.testing.assert_allclose(out_x, out_r, atol=1e-5)
    for a, b in zip(g_x, g_r):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("name", IMPLEMENTATIONS.names())
def test_traced_offsets_equal_static_offsets(name):
    """Ring attention passes offsets as traced values (the kernels' tile tables are
    then built in the graph and the grid walks every kv tile): same result, same
    gradients as python-int offsets."""
    q, k, v, _ = inputs(1, 100, 256, 4, 2, 32)
    mask = M.causal() & M.sliding_window(64)
    skip_unless_served(name, request(q, k, v, mask, offsets=True))
    attend = attention_fn(name, {"blockwise": dict(block_q=32, block_kv=64),
                                 "pallas": dict(block_sizes=BS_TPU)})

    def loss(q, k, v, qo, ko):
        return attend(q, k, v, mask, q_offset=qo, kv_offset=ko).sum()

    static_loss = lambda q, k, v: loss(q, k, v, 150, 0)
    static = jax.jit(jax.value_and_grad(static_loss, (0, 1, 2)))(q, k, v)
    traced = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v, jnp.int32(150), jnp.int32(0))
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", IMPLEMENTATIONS.names())
def test_two_runs_bitwise_equal(name):
    q, k, v, _ = inputs(2, 200, 200, 8, 2, 32)
    mask = M.causal() & M.segments(np.repeat([[0, 1]], 100, axis=1).reshape(1, -1).repeat(2, 0))
    skip_unless_served(name, request(q, k, v, mask))
    attend = attention_fn(name, {"blockwise": dict(block_q=64, block_kv=64),
                                 "pallas": dict(block_sizes=BS_TPU)})
    f = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v, mask).sum(), (0, 1, 2)))
    for x, y in zip(f(q, k, v), f(q, k, v)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", [n for n in IMPLEMENTATIONS.names() if n != ORACLE])
def test_gradients_through_a_model_equal_the_reference(name):
    """A one-layer attention block (projections, causal GQA attention, output),
    `implementation=name` against "reference"."""
    D, N, K, H, T = 32, 4, 2, 8, 50
    keys = jax.random.split(jax.random.key(3), 5)
    params = {"wq": jax.random.normal(keys[0], (D, N, H)) * 0.2,
              "wk": jax.random.normal(keys[1], (D, K, H)) * 0.2,
              "wv": jax.random.normal(keys[2], (D, K, H)) * 0.2,
              "wo": jax.random.normal(keys[3], (N, H, D)) * 0.2}
    x = jax.random.normal(keys[4], (2, T, D))
    sds = jax.ShapeDtypeStruct
    skip_unless_served(name, request(sds((2, T, N, H), jnp.float32),
                                     sds((2, T, K, H), jnp.float32), mask=M.causal()))

    def loss(params, impl):
        q = jnp.einsum("BTD,DNH->BTNH", x, params["wq"])
        k = jnp.einsum("BTD,DKH->BTKH", x, params["wk"])
        v = jnp.einsum("BTD,DKH->BTKH", x, params["wv"])
        o = dot_product_attention(q, k, v, M.causal(), implementation=impl)
        return jnp.mean(jnp.einsum("BTNH,NHD->BTD", o, params["wo"]) ** 2)

    want = jax.jit(jax.grad(loss), static_argnums=1)(params, ORACLE)
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, name)
    for key in params:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-4, err_msg=key)


# --------------------------------------------------------------------------- #
# Position biases given as parameters (ALiBi slopes, T5's table) against the same
# bias built at the layer level and passed as `bias=`.
# --------------------------------------------------------------------------- #


def _rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS.names())
def test_alibi_slopes_equal_the_explicit_alibi_bias(impl):
    """`alibi_slopes` is ALiBi at global index positions (offsets included) or at
    `alibi_positions`, the same as the layer-level `alibi_bias` passed as a bias;
    each implementation agrees with "reference", forward and gradients (the tiled
    ones at their default tiles here, at the suite's in `test_matches_reference`'s
    ALiBi cases); the slopes take no gradient."""
    from tfjax.nn.positions import alibi_bias, alibi_slopes

    q, k, v = _rand((2, 5, 4, 8), 30), _rand((2, 7, 2, 8), 31), _rand((2, 7, 2, 8), 32)
    skip_unless_served(impl, request(q, k, v, M.causal(), offsets=True, alibi=True))
    slopes = jnp.asarray(alibi_slopes(4))
    per_example = jnp.stack([slopes, 3.0 * slopes])  # [B, N]
    qo, ko = 4, 1
    index = (jnp.broadcast_to(jnp.arange(5) + qo, (2, 5)), jnp.broadcast_to(jnp.arange(7) + ko,
                                                                             (2, 7)))
    packed = (jnp.array([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]]), jnp.array([[0, 1, 2, 0, 1, 2, 3]]))

    @jax.jit
    def explicit(sl, pos):  # the layer's bias from position arrays, through `bias=`
        qp, kp = jnp.broadcast_to(pos[0], (2, 5)), jnp.broadcast_to(pos[1], (2, 7))
        sl = jnp.broadcast_to(sl, (2, 4))
        bias = jax.vmap(lambda a, b, s: alibi_bias(a[None], b[None], s)[0])(qp, kp, sl)
        return attention_reference(q, k, v, M.causal(), bias=bias, q_offset=qo, kv_offset=ko)

    def loss(impl, q, k, sl, pos):
        out = dot_product_attention(q, k, v, M.causal(), alibi_slopes=sl, alibi_positions=pos,
                                    q_offset=qo, kv_offset=ko, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    vg = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True), static_argnums=0)
    for sl, pos in ((slopes, None), (per_example, None), (per_example, packed)):
        want = explicit(sl, index if pos is None else pos)
        grads = {}
        for name in dict.fromkeys(("reference", impl)):
            (_, out), g = vg(name, q, k, sl, pos)
            np.testing.assert_allclose(out, want, atol=1e-5, err_msg=name)
            assert not np.asarray(g[2]).any()  # fixed slopes: no gradient
            grads[name] = g
        for a, b in zip(grads[impl][:2], grads["reference"][:2]):
            np.testing.assert_allclose(a, b, atol=1e-4)
    # the cases differ from each other and from no ALiBi (the checks above can fail)
    outs = [explicit(s, p) for s, p in ((0 * slopes, index), (slopes, index),
                                         (per_example, index), (per_example, packed))]
    for x, y in zip(outs, outs[1:]):
        assert np.abs(np.asarray(x - y)).max() > 1e-2


@pytest.mark.parametrize("impl", [*IMPLEMENTATIONS.names(), "attention_reference"])
def test_relative_bias_equals_the_explicit_t5_bias(impl):
    """`relative_bias` (T5's bucketed bias) at index positions (offsets included) or
    explicit ones equals the table gathered at the bucketed relative positions,
    passed as `bias=`: "reference" and "xla" (materialised by the dispatch),
    "blockwise" (per tile, tiny tiles), "pallas" (per tile in the TPU kernels,
    interpreted) and `attention_reference` itself, forward and gradients, the
    table's included."""
    from tfjax.nn.positions import relative_position_bucket
    from tfjax.ops import RelativeBias

    q, k, v = _rand((2, 5, 4, 8), 40), _rand((2, 7, 2, 8), 41), _rand((2, 7, 2, 8), 42)
    if impl != "attention_reference":
        skip_unless_served(impl, request(q, k, v, M.causal(), offsets=True, relative=True))
    table = _rand((8, 4), 43)
    qo, ko = 4, 1
    index = (jnp.arange(5)[None] + qo, jnp.arange(7)[None] + ko)
    packed = (jnp.array([[0, 1, 2, 0, 1], [3, 5, 7, 9, 11]]), jnp.array([[0, 2, 4, 0, 3, 6, 9]]))

    def explicit(table, pos, bidirectional):  # [B, N, T, S], gathered from the whole matrix
        qp, kp = jnp.broadcast_to(pos[0], (2, 5)), jnp.broadcast_to(pos[1], (2, 7))
        rel = kp[:, None, :] - qp[:, :, None]
        b = relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=8,
                                     max_distance=10)
        return jnp.moveaxis(table[b], -1, 1)

    def loss(impl, q, k, table, pos, bidirectional):
        if impl == "explicit":
            out = attention_reference(q, k, v, M.causal(), q_offset=qo, kv_offset=ko,
                                      bias=explicit(table, index if pos is None else pos,
                                                    bidirectional))
        else:
            rb = RelativeBias(table, bidirectional=bidirectional, max_distance=10,
                              q_positions=None if pos is None else pos[0],
                              kv_positions=None if pos is None else pos[1])
            if impl == "attention_reference":
                out = attention_reference(q, k, v, M.causal(), relative_bias=rb, q_offset=qo,
                                          kv_offset=ko)
            else:
                out = dot_product_attention(q, k, v, M.causal(), relative_bias=rb, q_offset=qo,
                                            kv_offset=ko, implementation=impl)
        return jnp.sum(out * jnp.cos(out)), out

    vg = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True), static_argnums=(0, 5))
    outs = []
    for pos, bidirectional in ((None, False), (None, True), (packed, True)):
        (_, want), g_want = vg("explicit", q, k, table, pos, bidirectional)
        assert np.abs(np.asarray(g_want[2])).max() > 1e-3  # the table is learned
        (_, out), g = vg(impl, q, k, table, pos, bidirectional)
        np.testing.assert_allclose(out, want, atol=1e-5, err_msg=impl)
        for a, b in zip(g, g_want):
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=impl)
        outs.append(want)
    # the cases differ from each other and from no bias (the checks above can fail)
    outs.append(attention_reference(q, k, v, M.causal(), q_offset=qo, kv_offset=ko))
    for x, y in zip(outs, outs[1:]):
        assert np.abs(np.asarray(x - y)).max() > 1e-2
