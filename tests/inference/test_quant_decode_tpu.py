"""The decode step of a model with int8 / int4 weights (`quantize_weights`), compiled by
XLA:TPU for a v5e chip on this CPU: its matmuls take the s8 / s4 weights as operands
(the scales multiply the products) and no float copy of a quantized weight exists in
the optimized HLO (docs/quantization.md, "Serving")."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tfjax import models
from tfjax.config import model_config
from tfjax.nn.quant import QuantizedParam, quantize_weights

# d_model 256, head dim 64, ffn 512, vocab 384: a TPU's (8, 128) tiles, and no float
# array (embeddings, head, activations) of a quantized weight's shape
SMALL = dict(vocab_size=384, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2,
             d_ff=512, max_len=128, tie_embeddings=False, dtype="bfloat16",
             param_dtype="bfloat16")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[([\d,]*)\]")
_DOT = re.compile(r"\b(?:dot|convolution)\(([^)]*)\)")


def hlo_arrays(hlo: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{instruction name: (element type, shape)} of an HLO module's text."""
    return {m.group(1): (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d))
            for m in map(_DEF.match, hlo.splitlines()) if m}


def dot_operands(hlo: str) -> collections.Counter:
    """{(lhs type, rhs type): count} of the dots / convolutions (XLA:TPU's matmuls)."""
    arrays, out = hlo_arrays(hlo), collections.Counter()
    for line in hlo.splitlines():
        if m := _DOT.search(line):
            names = [o.strip().lstrip("%") for o in m.group(1).split(",")]
            out[tuple(arrays.get(n, ("?",))[0] for n in names)] += 1
    return out


def test_hlo_readers_take_types_and_shapes_across_lines():
    hlo = ("%w.1 = s8[256,512]{1,0:T(8,128)(4,1)} parameter(0)\n"
           "%x = bf16[2,256]{1,0} parameter(1)\n"
           "ROOT %c = f32[2,512]{1,0} convolution(%x, %w.1), dim_labels=bf_io->bf")
    assert hlo_arrays(hlo)["w.1"] == ("s8", (256, 512))
    assert dot_operands(hlo) == {("bf16", "s8"): 1}


def compiled_decode(fmt: str, group):
    """(optimized HLO text, {per-layer shape of each quantized weight}) of the one-token
    decode step over a 2 x 64 cache, compiled for one v5e chip."""
    from tfjax.train.aot import tpu_devices

    devices, _ = tpu_devices("v5e:2x2")
    rep = NamedSharding(Mesh(np.asarray(devices[:1]), ("data",)), P())
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: quantize_weights(
            models.build(model_config(SMALL), rngs=nnx.Rngs(0)), fmt, group=group))
    shapes = {tuple(v.get_value().qvalue.shape[1:])  # the scanned layer axis dropped
              for _, v in nnx.iter_graph(model) if isinstance(v, QuantizedParam)}
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(2, 64))
    abstract = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t)

    def decode(state, cache, tokens):
        return nnx.merge(graphdef, state).step(tokens, cache)

    compiled = jax.jit(decode, donate_argnums=1).lower(
        abstract(state), abstract(cache),
        jax.ShapeDtypeStruct((2, 1), jnp.int32, sharding=rep)).compile()
    return compiled.as_text(), shapes


@pytest.mark.parametrize("fmt,group,qtype", [("int8", None, "s8"), ("int4", None, "s4"),
                                             ("int8", 128, "s8")])
def test_the_tpu_decode_step_reads_quantized_weights_into_its_dots(fmt, group, qtype):
    pytest.importorskip("libtpu")
    hlo, shapes = compiled_decode(fmt, group)
    ops = dot_operands(hlo)
    # the stack's matmuls (q, k, v, o, wi_gate, wi_up, wo; XLA may merge some) take
    # s8 / s4; float x float are attention's two products and the float head's alone
    assert sum(n for k, n in ops.items() if qtype in k) >= 5, ops
    assert sum(n for k, n in ops.items() if qtype not in k) <= 3, ops
    # ... and no float array of a quantized weight's (per-layer) shape is ever written
    floats = {(t, s) for t, s in hlo_arrays(hlo).values() if t in ("bf16", "f32")}
    grouped = {s[:-2] + (s[-2] // group, group, s[-1]) for s in shapes} if group else set()
    copies = {(t, s) for t, s in floats if s in shapes | grouped}
    assert not copies, (copies, shapes)
