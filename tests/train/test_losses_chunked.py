"""The chunked next-token loss (`chunked_cross_entropy_sums`, `train.loss_chunk`):
equal to the plain formula on the materialised logits, loss and gradients, through
the decoder objectives; and no `[B, T, V]` array anywhere in its gradient's program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_walk import equations

from tfjax import config as C
from tfjax import models
from tfjax.config import model_config
from tfjax.train.losses import chunked_cross_entropy_sums, cross_entropy_sums
from tfjax.train.objectives import OBJECTIVES
from tfjax.train.step import make_eval_step, make_train_step

B, T, V = 2, 13, 61  # T = 13: 4 chunks of 4 with 3 padded positions at chunk=4
CASES = {
    "tied": ("causal_lm", dict()),
    "untied_softcap_scaled": ("causal_lm", dict(tie_embeddings=False, final_softcap=3.0,
                                                mup_base_width=16)),
    "prefix_lm": ("prefix_lm", dict(prefix_lm=True)),
}


def batch(seed=0):
    r = np.random.default_rng(seed)
    seg = np.array([[1] * 6 + [2] * 7, [1] * 13])
    pos = np.array([list(range(6)) + list(range(7)), list(range(13))])
    mask = r.integers(0, 2, (B, T)) * (pos > 0)  # masked tokens, and document starts
    return {k: jnp.asarray(v) for k, v in dict(
        inputs=r.integers(0, V, (B, T)), targets=r.integers(0, V, (B, T)), mask=mask,
        segment_ids=seg, positions=pos, target_bytes=r.integers(0, 3, (B, T)),
        prefix_lengths=np.array([3, 5])).items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_loss_equals_the_materialised_logits(name):
    """f32: the sums bitwise, z-loss included; gradients of nll + 0.1 z within rounding
    (the head's is summed chunk by chunk)."""
    objective, extra = CASES[name]
    cfg = model_config(dict(vocab_size=V, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                            max_len=64, **extra))
    model, b = models.build(cfg, rngs=nnx.Rngs(3)), batch()
    forward = OBJECTIVES.get(objective).forward

    @nnx.jit(static_argnums=1)
    def sums_and_grads(m, chunk):
        def loss(m):
            s = forward(m, b, loss_chunk=chunk)
            return s["nll"] + 0.1 * s["z"], s
        return nnx.grad(loss, has_aux=True)(m)

    g0, s0 = sums_and_grads(model, 0)
    g4, s4 = sums_and_grads(model, 4)
    for k in ("nll", "z", "tokens", "bytes"):
        np.testing.assert_array_equal(s4[k], s0[k], err_msg=k)
    assert float(s0["tokens"]) == float(b["mask"].sum()) > 0
    flat0, flat4 = (jax.tree.leaves(nnx.state(g, nnx.Param)) for g in (g0, g4))
    assert len(flat0) == len(flat4) > 0
    for a, c in zip(flat0, flat4):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6 * float(jnp.abs(a).max()))


def test_masked_positions_get_no_gradient_and_padding_costs_nothing():
    """Chunked over an awkward T: the hidden states of masked tokens get exactly zero
    gradient, and chunk counts that pad T give the same sums."""
    r = np.random.default_rng(1)
    D = 8
    x = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)
    w = jnp.asarray(r.normal(size=(D, V)), jnp.float32)
    b = batch(1)

    def nll(x, chunk):
        return chunked_cross_entropy_sums(lambda h: h @ w, x, b["targets"], b["mask"],
                                          chunk=chunk)["nll"]

    plain = cross_entropy_sums(x @ w, b["targets"], b["mask"])["nll"]
    for chunk in (1, 3, 4, 5, 12):
        np.testing.assert_allclose(nll(x, chunk), plain, rtol=1e-6)
    g = jax.grad(nll)(x, 5)
    assert np.abs(np.asarray(g)[np.asarray(b["mask"]) == 0]).max() == 0
    assert np.abs(np.asarray(g)[np.asarray(b["mask"]) == 1]).min() > 0


def _shapes(jaxpr):
    """The shapes of every value a jaxpr makes, inside scans and checkpoints too."""
    for eqn, _ in equations(jaxpr):
        for v in eqn.outvars:
            yield getattr(v.aval, "shape", ())


def test_gradient_program_holds_no_whole_logits():
    """Forward and backward: no value of B*T*V elements or more (as the materialised
    logits, or the scan saving every chunk's logits for the backward, would be)."""
    Tl, D, Vl, chunk = 64, 8, 512, 16
    x = jnp.zeros((B, Tl, D))
    w = jnp.zeros((D, Vl))
    t, m = jnp.zeros((B, Tl), jnp.int32), jnp.ones((B, Tl))

    def loss(x, w, chunk):
        s = chunked_cross_entropy_sums(lambda h: jnp.tanh(h @ w), x, t, m, chunk=chunk)
        return s["nll"] + s["z"]

    def biggest(chunk):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, chunk)
        return max(int(np.prod(s)) for s in _shapes(jaxpr.jaxpr))

    assert biggest(0) >= B * Tl * Vl  # the plain formula does hold them (the test can fail)
    assert biggest(chunk) <= B * chunk * Vl


def test_train_and_eval_steps_read_train_loss_chunk():
    """`train.loss_chunk` reaches the loss through make_train_step / make_eval_step:
    one SGD step with z-loss lands on the same parameters, chunked or not."""
    cfg = model_config(dict(vocab_size=V, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                            max_len=64))
    graphdef, params, rest = nnx.split(models.build(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.sgd(0.1)
    state = dict(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params), rest=rest)
    b = {k: v for k, v in batch(2).items() if k != "prefix_lengths"}
    out = {}
    for chunk in (0, 4):
        t = C.from_dict(C.TrainConfig, dict(loss_chunk=chunk, z_loss=0.1, grad_clip=0.0))
        new, metrics = jax.jit(make_train_step(graphdef, tx, t))(state, b)
        sums = jax.jit(make_eval_step(graphdef, loss_chunk=chunk))(state, b)
        out[chunk] = jax.tree.leaves(new["params"]), metrics, sums
    (p0, m0, s0), (p4, m4, s4) = out[0], out[4]
    assert float(m4["loss"]) == float(m0["loss"]) and float(s4["nll"]) == float(s0["nll"])
    for a, c in zip(p0, p4):
        np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-7)


def test_a_sequence_sharded_row_keeps_loss_chunk_positions_on_each_device():
    """With the row's positions split over the mesh's sequence axis, a chunk spans
    loss_chunk x shards positions (loss_chunk on each device): 4 times fewer trips of
    the scan on 4 sequence shards, each of which reduces the head's gradient over the
    devices once (per trip it was the whole head at 8B: 64 GiB a step); the same sums."""
    from jaxpr_walk import of_primitive

    from tfjax.parallel.mesh import make_mesh
    from tfjax.parallel.rules import logical_rules
    from tfjax.parallel.sharding import use_rules

    Tl, D, Vl, chunk = 64, 8, 32, 4
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(B, Tl, D)), jnp.float32)
    w = jnp.asarray(r.normal(size=(D, Vl)), jnp.float32)
    t = jnp.asarray(r.integers(0, Vl, (B, Tl)))
    m = jnp.ones((B, Tl))

    def loss(x):
        return chunked_cross_entropy_sums(lambda h: h @ w, x, t, m, chunk=chunk)["nll"]

    def trips():  # a new function each time: traced afresh under the active rules
        jaxpr = jax.make_jaxpr(lambda x: loss(x))(x).jaxpr
        return [e.params["length"] for e in of_primitive(jaxpr, "scan")]

    plain = cross_entropy_sums(x @ w, t, m)["nll"]
    assert trips() == [Tl // chunk]
    with use_rules(make_mesh(C.MeshConfig(data=2, sequence=4)), logical_rules(C.DEFAULT_RULES)):
        assert trips() == [Tl // (chunk * 4)]
        np.testing.assert_allclose(jax.jit(lambda x: loss(x))(x), plain, rtol=1e-6)
