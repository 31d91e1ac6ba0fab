"""The one VJP shell of the tiled attentions (`tfjax.ops.vjp`): what it hands the
implementation's backward and the cotangents it returns (zeros for the mask, ALiBi
and the offsets, float0 for integers; T5's table its gradient in its dtype), the
forward it runs under differentiation, and the backward's per-row terms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.ops import RelativeBias
from tfjax.ops import masks as M
from tfjax.ops.reference import Alibi
from tfjax.ops.vjp import attention_vjp, backward_rows, zero_cotangent, zero_cotangents


def test_zero_cotangents_are_zeros_and_float0_for_integers():
    assert zero_cotangent(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.bfloat16
    assert not np.asarray(zero_cotangent(jnp.ones(3))).any()
    assert zero_cotangent(jnp.arange(3)).dtype == jax.dtypes.float0
    assert zero_cotangent(7).shape == () and zero_cotangent(7).dtype == jax.dtypes.float0
    tree = zero_cotangents(M.segments(np.zeros((1, 4), np.int32)) & M.causal())
    assert [x.dtype for x in jax.tree.leaves(tree)] == [jax.dtypes.float0] * 2
    assert zero_cotangents(None) is None


def test_backward_rows():
    """dO in the kernels' dtype, delta = rowsum(dO * O) - dlse, and fully masked
    rows' lse (-inf) at 0."""
    rng = np.random.default_rng(0)
    out = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)  # [B, T, N, H]
    dout = jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32)
    lse = jnp.array([[[0.5, -jnp.inf, 2.0], [1.0, 1.0, -jnp.inf]]])  # [B, N, T]
    dlse = jnp.full((1, 2, 3), 0.25)
    do, lse0, delta = backward_rows(out, lse, dout, jnp.bfloat16, dlse)
    assert do.dtype == jnp.bfloat16
    np.testing.assert_array_equal(lse0, [[[0.5, 0.0, 2.0], [1.0, 1.0, 0.0]]])
    want = np.einsum("btnh,btnh->bnt", np.asarray(do, np.float32), np.asarray(out)) - 0.25
    np.testing.assert_allclose(delta, want, rtol=1e-6)
    _, _, no_dlse = backward_rows(out, lse, dout, jnp.bfloat16)
    np.testing.assert_allclose(no_dlse, want + 0.25, rtol=1e-6)


def test_the_shell_passes_residuals_and_builds_the_cotangents():
    """A toy implementation (out = v, lse = row sums of q) through the shell: the
    backward sees the saved inputs, out, lse and both cotangents, and its gradients
    come back for q, k, v, the bias and T5's table (cast to the table's dtype);
    the mask, ALiBi and the offsets get zeros. `forward_for_grad` runs only under
    differentiation."""
    seen, forwards = {}, []

    def compute(cfg, q, k, v, mask, bias, alibi, rel, offsets):
        return v * cfg, q.sum(-1).transpose(0, 2, 1)

    def forward(cfg, *args):
        forwards.append("primal")
        return compute(cfg, *args)

    def forward_for_grad(cfg, *args):
        forwards.append("for_grad")
        return compute(cfg, *args)

    def backward(cfg, q, k, v, mask, bias, alibi, rel, offsets, out, lse, dout, dlse):
        seen.update(out=out, lse=lse, dout=dout, dlse=dlse, offsets=offsets)
        dtable = jnp.full(rel.table.shape, 3.0, jnp.float32)
        return 2 * q, 3 * k, cfg * dout, jnp.ones_like(bias), dtable

    attention = attention_vjp(forward, backward, forward_for_grad=forward_for_grad)
    q = k = v = jnp.ones((1, 2, 2, 4))
    bias = jnp.zeros((1, 2, 2, 2))
    alibi = Alibi(jnp.ones((1, 2)), None, None)
    rel = RelativeBias(jnp.zeros((8, 2), jnp.bfloat16), bidirectional=True,
                       q_positions=jnp.zeros((1, 2), jnp.int32),
                       kv_positions=jnp.zeros((1, 2), jnp.int32))
    mask = M.segments(np.zeros((1, 2), np.int32))
    offsets = (jnp.int32(3), jnp.int32(5))

    def loss(q, k, v, bias, rel):
        out, lse = attention(2.0, q, k, v, mask, bias, alibi, rel, offsets)
        return out.sum() + 0.5 * lse.sum()

    attention(2.0, q, k, v, mask, bias, alibi, rel, offsets)
    assert forwards == ["primal"]
    dq, dk, dv, dbias, drel = jax.grad(loss, (0, 1, 2, 3, 4), allow_int=True)(
        q, k, v, bias, rel)
    assert forwards == ["primal", "for_grad"]
    np.testing.assert_array_equal(dq, 2 * q)
    np.testing.assert_array_equal(dk, 3 * k)
    np.testing.assert_array_equal(dv, 2.0 * jnp.ones_like(v))  # cfg * dout, dout = 1
    np.testing.assert_array_equal(dbias, jnp.ones_like(bias))
    assert drel.table.dtype == jnp.bfloat16 and (np.asarray(drel.table, np.float32) == 3).all()
    assert drel.q_positions.dtype == jax.dtypes.float0
    np.testing.assert_array_equal(seen["out"], 2 * v)
    np.testing.assert_array_equal(seen["dlse"], jnp.full((1, 2, 2), 0.5))
    assert [int(o) for o in seen["offsets"]] == [3, 5]
    assert dataclasses.is_dataclass(drel)
