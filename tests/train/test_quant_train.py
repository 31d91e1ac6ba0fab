"""Quantized training through the trainer (`model.quant`, `tfjax.nn.quant`): under a
data x fsdp x tensor mesh of 8 simulated CPU devices its losses follow float's; the
train step compiled for a TPU slice on this CPU holds s8 (int8) and f8 (fp8) dots in
XLA's optimized HLO, and the float step none."""

import collections
import re

import numpy as np
import pytest
from tiny_setup import devices, tiny_config

from tfjax.train import Trainer, aot

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[")
_DOT = re.compile(r"\b(?:dot|convolution)\(([^)]*)\)")


def dot_operand_types(hlo: str) -> collections.Counter:
    """{(lhs element type, rhs element type): count} over the dots and convolutions of
    an HLO module's text (XLA:TPU writes matmuls as either)."""
    types = {m.group(1): m.group(2) for m in map(_DEF.match, hlo.splitlines()) if m}
    out = collections.Counter()
    for line in hlo.splitlines():
        if m := _DOT.search(line):
            names = [o.strip().lstrip("%") for o in m.group(1).split(",")]
            out[tuple(types.get(n, "?") for n in names)] += 1
    return out


def test_dot_operand_types_reads_names_across_lines():
    hlo = ("%a.1 = s8[4,8]{1,0} parameter(0)\n%b = f8e4m3fn[8,2]{1,0} fusion(%x)\n"
           "ROOT %d = s32[4,2]{1,0} dot(%a.1, %b), lhs_contracting_dims={1}\n"
           "%c = f32[2]{0} convolution(%a.1, %a.1), window={}")
    assert dot_operand_types(hlo) == {("s8", "f8e4m3fn"): 1, ("s8", "s8"): 1}


def run(tmp_path, quant, mesh):
    cfg = tiny_config(model=dict(quant=quant), mesh=mesh)
    tr = Trainer(cfg, str(tmp_path / quant), devices=devices(8), log=lambda s: None)
    return tr.train()["history"]


@pytest.mark.slow
def test_int8_under_a_data_fsdp_tensor_mesh_follows_float(tmp_path):
    """Four steps (lr 1e-2) on 2 x 2 x 2 devices: int8's losses within 2 % of float's,
    and it learns."""
    mesh = dict(data=2, fsdp=2, tensor=2)
    f, q = run(tmp_path, "none", mesh), run(tmp_path, "int8", mesh)
    assert sorted(q) == sorted(f) == [1, 2, 3, 4]
    np.testing.assert_allclose([q[k] for k in (1, 2, 3, 4)], [f[k] for k in (1, 2, 3, 4)],
                               rtol=0.02)
    assert q[4] < q[1]


@pytest.mark.slow
@pytest.mark.parametrize("quant, want", [
    ("none", set()),
    ("int8", {("s8", "s8")}),
    ("fp8", {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}),
])
def test_tpu_train_step_holds_quantized_dots(quant, want):
    """The v5e:2x2 train step (fsdp 2 x tensor 2): the stack's matmuls, forward and both
    gradients, are dots of quantized operands (fp8: e4m3 x e4m3 forward, e5m2 gradients
    against e4m3 operands); the float step has no 8-bit operand at all."""
    pytest.importorskip("libtpu")
    cfg = tiny_config(model=dict(quant=quant), train=dict(batch_size=8, microbatches=1),
                      mesh=dict(data=1, fsdp=2, tensor=2)).validate()
    compiled, _, _, _ = aot.compile_step(cfg, "v5e:2x2")
    ops = dot_operand_types(compiled.as_text())
    eight_bit = {k for k in ops if any(t.startswith(("s8", "f8")) for t in k)}
    assert eight_bit == want, ops
    if quant != "none":  # 2 layers x (4 projections + 2 ffn) x (forward + 2 gradients)
        assert sum(ops[k] for k in want) >= 2 * 6 * 3 * 0.5, ops
