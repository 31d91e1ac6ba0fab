"""The Triton kernels (`tfjax.ops.pallas.triton`): lowered to Triton for the cuda
platform without a GPU (the Triton lowering rules of every kernel; the Triton
compiler itself runs only on a GPU, in the accelerator-marked tests), the launch
table (`triton_launch.json`, the choice of the ptxas table it names) and the
launches the lowered calls carry, `TritonConfig`'s checks, the launch order of
query tiles. Against the reference in interpret mode: test_implementations.py."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import check_against_reference, inputs, lower_for_cuda
from jaxpr_walk import of_primitive

from tfjax.ops import masks as M
from tfjax.ops.pallas import BlockSizes, flash_attention_gpu



def _lower_for_cuda(mask_name, H, dtype, bias, alibi=False, relative=None, Hv=None):
    """`relative`: T5's bias at the index positions ("index") or at the segment-id
    operands as positions ("pos"). `Hv`: v's head dim (default H); with it, learned
    sinks on the kernels' (out, lse) as the dispatch adds them."""
    from tfjax.ops import RelativeBias
    from tfjax.ops.sinks import add_sinks
    B, T, S, N, K = 2, 300, 500, 8, 2
    sds = jax.ShapeDtypeStruct

    def f(q, k, v, qs, ks, b):
        mask = {"causal": M.causal(), "window": M.sliding_window(128),
                "causal&segments": M.causal() & M.segments(qs, ks),
                "prefix|padding": M.prefix_lm(qs[:, 0]) | M.padding(ks[:, 0])}[mask_name]
        slopes = jnp.linspace(0.5, 0.01, N) if alibi else None
        rel = None
        if relative:
            pos = (qs, ks) if relative == "pos" else (None, None)
            rel = RelativeBias(jnp.ones((32, N)), bidirectional=relative == "pos",
                               q_positions=pos[0], kv_positions=pos[1])
        def loss(q, k, v, b):
            out, lse = flash_attention_gpu(q, k, v, mask, bias=b, softcap=30.0,
                                           alibi_slopes=slopes, relative_bias=rel,
                                           forward="triton", backward="triton", return_lse=True)
            if Hv:
                out = add_sinks(out, lse, jnp.linspace(-1.0, 2.0, N))[0]
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2, 3) if bias else (0, 1, 2))(q, k, v, b)

    args = (sds((B, T, N, H), dtype), sds((B, S, K, H), dtype), sds((B, S, K, Hv or H), dtype),
            sds((B, T), jnp.int32), sds((B, S), jnp.int32),
            sds((1, N, T, S), jnp.float32) if bias else None)
    return lower_for_cuda(f, *args)


@pytest.mark.parametrize("mask_name,H,dtype,bias,alibi,relative,Hv", [
    ("causal", 128, jnp.bfloat16, False, False, None, None),
    ("causal&segments", 64, jnp.float16, True, False, "pos", None),
    ("window", 256, jnp.bfloat16, False, True, None, None),
    ("prefix|padding", 80, jnp.float32, False, False, "index", None),
    ("causal", 192, jnp.bfloat16, False, False, None, 128),  # DeepSeek's dims, sinks
])
def test_kernels_lower_to_triton(mask_name, H, dtype, bias, alibi, relative, Hv):
    try:
        text = _lower_for_cuda(mask_name, H, dtype, bias, alibi, relative, Hv)
    except Exception as e:
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for cuda: {str(e).splitlines()[0][:120]}")
        raise
    assert text.count("xla.gpu.triton") == 3  # forward, dq, dk/dv


@pytest.mark.accelerator
def test_on_gpu_matches_reference():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, bias = inputs(2, 1000, 1000, 8, 2, 128, dtype=jnp.bfloat16, bias=(1, 1))
    mask = M.causal() & M.segments(np.repeat(np.arange(4), 250)[None].repeat(2, 0))
    check_against_reference(flash_attention_gpu, q, k, v, mask, bias, softcap=30.0)


@pytest.mark.accelerator
def test_on_gpu_t5_bias_matches_reference():
    """T5's bias per tile in the compiled Triton kernels (the table's gather and the
    dq kernel's per-bucket sums), bf16, packed positions."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v, _ = inputs(2, 1000, 1000, 8, 2, 128, dtype=jnp.bfloat16)
    mask = M.causal() & M.segments(np.repeat(np.arange(4), 250)[None].repeat(2, 0))
    check_against_reference(flash_attention_gpu, q, k, v, mask, relative="pos")


def _gpu_registers():
    """experiments/gpu_registers.py as a module (it runs on CPU for this)."""
    import importlib.util
    import os
    import sys

    here = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
    sys.path.insert(0, here)
    try:
        spec = importlib.util.spec_from_file_location(
            "experiments_gpu_registers", os.path.join(here, "gpu_registers.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(here)
    return module


def test_triton_launches_are_the_ptxas_tables_choice():
    """`triton.LAUNCH` (the package's triton_launch.json) is the documented rule
    applied to the ptxas table it names (experiments/gpu_registers.py for an H200,
    no GPU), and the file is what `gpu_registers.py --write-launch` writes from that
    table: re-measuring and forgetting to rewrite the file, or editing a launch by
    hand, fails here. At every head dim and feature class the default tiles launch
    at a configuration that compiled (T5's bias at H=256 overflowed shared memory at
    the 3-stage forward), and for index masks ("plain") one at which ptxas spilled
    nothing."""
    import importlib.resources
    import json
    import os

    from tfjax.ops.pallas import triton as gpu

    registers = _gpu_registers()
    text = importlib.resources.files("tfjax.ops.pallas").joinpath(
        "triton_launch.json").read_text()
    measured_path = json.loads(text)["measured"]
    assert measured_path == "experiments/results/attention_gpu_ptxas_20261130.md"
    rows = registers.read_table(os.path.join(registers.ROOT, measured_path))
    assert len(rows) > 300
    assert gpu.LAUNCH == registers.choose(rows)
    assert text == registers.launch_json(registers.choose(rows), measured_path)
    measured = {(r["features"], r["kernel"], r["H"], r["bq"], r["bk"], r["warps"],
                 r["stages"]): r for r in rows}
    for H, features in itertools.product((64, 128, 256), ("plain", "masked", "t5")):
        bs = gpu.default_block_sizes(H)
        for kern, tiles in (("fwd", (bs.block_q, bs.block_kv)),
                            ("dq", (bs.block_q_dq, bs.block_kv_dq)),
                            ("dkv", (bs.block_q_dkv, bs.block_kv_dkv))):
            launch = gpu.triton_launch(kern, H, *tiles, features)
            row = measured.get((features, kern, H, *tiles, *launch))
            assert row is not None, (H, features, kern, tiles, launch)
            if features == "plain":
                assert row["spill"] == 0, (H, kern, tiles, launch, row)


def test_gpu_registers_writes_the_launch_file(tmp_path):
    """`--write-launch` writes the choice of a results table, one launch a line,
    naming the table; the package reads a changed file's launches."""
    import json

    registers = _gpu_registers()
    table = tmp_path / "attention_gpu_ptxas_test.md"
    table.write_text("| 128 | plain | fwd | 128x64 | 4, 2 | 168 | 0 / 0 | 96.0 | 2 (registers) |\n"
                     "| 128 | plain | fwd | 128x64 | 8, 2 | 96 | 0 / 0 | 96.0 | 2 (registers) |\n"
                     "| 128 | plain | fwd | 128x64 | 4, 3 | 255 | 8 / 8 | 128.0 | 1 (registers) |\n")
    out = registers.write_launch(str(table), str(tmp_path / "launch.json"))
    data = json.loads(open(out).read())
    assert data["columns"] == list(registers.LAUNCH_COLUMNS)
    assert data["launches"] == [["plain", "fwd", 128, 128, 64, 4, 2]]  # no spill, fewer warps
    assert data["measured"].endswith("attention_gpu_ptxas_test.md")
    # a line a key, a launch a line
    assert open(out).read().count("\n") == len(data) + len(data["launches"]) + 3


@pytest.mark.parametrize("H,override,features", [
    (128, None, "plain"), (256, None, "plain"), (32, None, "plain"), (128, "config", "plain"),
    (128, None, "masked"), (256, None, "t5")])
def test_kernels_lower_with_the_chosen_warps_and_stages(H, override, features):
    """The lowered Triton calls carry `triton_launch`'s (warps, stages) for the tiles
    each kernel really runs (clamped to the sequence; head dims padded) and the
    call's feature class (segments, ALiBi or soft-capping: "masked"; T5's bias:
    "t5"), or a `TritonConfig`'s when one is passed."""
    import re

    from tfjax.ops import RelativeBias
    from tfjax.ops.pallas.triton import TritonConfig, default_block_sizes, triton_launch

    T, S = 100, 512  # query tiles clamp to 128, key tiles stay
    tc = TritonConfig(num_warps=2, num_stages=4, num_warps_dq=16, num_stages_dq=1,
                      num_warps_dkv=1, num_stages_dkv=3) if override else None
    kw = dict(mask=M.causal())
    if features == "masked":
        kw = dict(mask=M.causal() & M.segments(np.zeros((1, T), np.int32),
                                               np.zeros((1, S), np.int32)))
    elif features == "t5":
        kw = dict(mask=M.causal(), relative_bias=RelativeBias(jnp.ones((32, 8)),
                                                              bidirectional=False))

    def f(q, k, v):
        loss = lambda q, k, v: flash_attention_gpu(
            q, k, v, forward="triton", backward="triton", triton_config=tc,
            **kw).astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    sds = jax.ShapeDtypeStruct
    try:
        text = lower_for_cuda(f, sds((1, T, 8, H), jnp.bfloat16), sds((1, S, 2, H), jnp.bfloat16),
                              sds((1, S, 2, H), jnp.bfloat16))
    except Exception as e:
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower for cuda: {str(e).splitlines()[0][:120]}")
        raise
    got = {}
    for name, stages, warps in re.findall(r'name = "tfjax_flash_(\w+)_gpu".*?num_stages = (\d+)'
                                          r'.*?num_warps = (\d+)', text, re.S):
        got[name] = (int(warps), int(stages))
    if override:
        want = {k: tc.launch(k) for k in ("fwd", "dq", "dkv")}
    else:
        bs, Hp = default_block_sizes(H), max(16, 1 << (H - 1).bit_length())
        clamp = lambda b, n: max(16, min(b, 1 << (n - 1).bit_length()))
        want = {kern: triton_launch(kern, Hp, clamp(bq, T), clamp(bk, S), features)
                for kern, bq, bk in (("fwd", bs.block_q, bs.block_kv),
                                     ("dq", bs.block_q_dq, bs.block_kv_dq),
                                     ("dkv", bs.block_q_dkv, bs.block_kv_dkv))}
    assert got == want, (got, want)
    if H == 128 and not override and features == "plain":  # measured, not the old fixed 4
        assert got == {"fwd": (4, 2), "dq": (4, 2), "dkv": (8, 2)}
    if H == 128 and features == "masked":  # more registers than plain: more warps
        assert got["fwd"] != triton_launch("fwd", 128, 128, 64, "plain")


def test_triton_config_names_a_bad_field():
    from tfjax.ops.pallas.triton import TritonConfig

    with pytest.raises(ValueError, match="TritonConfig.num_warps_dkv must be 1, 2, 4, 8 or 16"):
        TritonConfig(num_warps_dkv=3)
    with pytest.raises(ValueError, match="TritonConfig.num_stages must be 1 to 8"):
        TritonConfig(num_stages=0)


def test_query_tiles_launch_heaviest_first():
    """GPUs start programs in grid order; under a causal mask query tile i visits
    i + 1 kv tiles, so the forward and dq grids give grid index 0 the last query
    tile (experiments/launch_order.py models the tail this shortens). Every block
    of those calls that moves with the grid's first axis follows the same reversed
    tile (a mismatch would also break the numerics tests); the dk/dv grid keeps kv
    tile 0, its heaviest, first."""
    q = jnp.zeros((1, 300, 2, 64), jnp.float32)  # 5 tiles of 64
    bs = BlockSizes(64, 64, 64, 64, 64, 64)
    loss = lambda q: flash_attention_gpu(q, q, q, M.causal(), forward="triton",
                                         backward="triton", block_sizes=bs,
                                         interpret=True).sum()
    calls = of_primitive(jax.make_jaxpr(jax.grad(loss))(q).jaxpr, "pallas_call")
    first = {"tfjax_flash_fwd_gpu": (4, 3), "tfjax_flash_dq_gpu": (4, 3),
             "tfjax_flash_dkv_gpu": (0, 1)}
    seen = set()
    for eqn in calls:
        name = str(eqn.params.get("name_and_src_info") or eqn.params.get("name")).split()[0]
        gm = eqn.params["grid_mapping"]
        moving = 0
        for bm in gm.block_mappings:
            cj = bm.index_map_jaxpr
            at = lambda g: [int(x) for x in jax.core.eval_jaxpr(cj.jaxpr, cj.consts, *g)]
            rest = (0,) * (len(gm.grid) - 1)
            a, b = at((0, *rest)), at((1, *rest))
            for x, y in zip(a, b):
                if x != y:
                    moving += 1
                    assert (x, y) == first[name], (name, bm.block_shape, a, b)
        assert moving >= 3, (name, moving)  # q (or k, v) tiles, outputs, lse rows
        seen.add(name)
    assert seen == set(first)
