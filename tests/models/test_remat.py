"""Rematerialisation policies (`model.remat`, `tfjax.models.stack.REMAT_POLICIES`):
every one gives the gradients of no checkpointing, and the ones that keep the named
attention residuals ("attn_out", "attn_lse") never run the forward kernel again in
the backward."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_walk import equations, of_primitive

from tfjax import models
from tfjax.config import model_config
from tfjax.models.stack import REMAT_POLICIES

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
            max_len=64)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)


def _loss(graphdef):
    def loss(state):
        logits = nnx.merge(graphdef, state)(TOKENS)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return loss


def _model(remat, **kw):
    return nnx.split(models.build(model_config({**TINY, "remat": remat, **kw}),
                                  rngs=nnx.Rngs(1)))


def test_every_policy_gives_the_gradients_of_none():
    graphdef, state = _model("none")
    ref = jax.tree.leaves(jax.jit(jax.grad(_loss(graphdef)))(state))
    for name in REMAT_POLICIES:
        if name == "none":
            continue
        graphdef, state = _model(name)
        got = jax.tree.leaves(jax.jit(jax.grad(_loss(graphdef)))(state))
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)


def _kernels(jaxpr):
    """pallas_call kernel name -> how many calls the jaxpr makes."""
    counts = collections.Counter()
    for eqn in of_primitive(jaxpr, "pallas_call"):
        info = eqn.params.get("name_and_src_info", eqn.params.get("name"))
        counts[str(getattr(info, "name", info)).split()[0]] += 1
    return counts


@pytest.mark.parametrize("remat,reruns", [("full", True), ("dots", True), ("attn", False),
                                          ("qkv_attn", False), ("dots_attn", False),
                                          ("attn_offload", False)])
def test_named_policies_keep_the_attention_forward(remat, reruns):
    """The Pallas kernels' program (traced, not run): the backward of "full" runs the
    forward kernel again (a kernel's output is no dot, so "dots" does too); the
    policies that keep "attn_out" and "attn_lse" run it once per layer."""
    graphdef, state = _model(remat, attention=dict(impl="pallas"))
    counts = _kernels(jax.make_jaxpr(jax.grad(_loss(graphdef)))(state).jaxpr)
    fwd = [n for n in counts if n.endswith("_fwd")]
    bwd = sum(counts[n] for n in counts if n not in fwd)
    assert len(fwd) == 1 and bwd > 0, counts
    assert counts[fwd[0]] == (bwd if reruns else bwd // 2), counts  # dq + dkv per layer


def _depths(jaxpr, name):
    """The nesting depth (0: the top level) of every `name` equation in a jaxpr."""
    return [depth for eqn, depth in equations(jaxpr) if eqn.primitive.name == name]


@pytest.mark.parametrize("scan", [True, False])
def test_rope_tables_are_computed_once_outside_the_layers(scan):
    """The stack computes each distinct RoPE's sin/cos once a call, before the layer
    scan and its remat (here two: the global layers' base and the local layers'),
    and the gradient does not recompute them."""
    graphdef, state = _model("dots_attn", num_layers=4, layer_pattern=("local", "global"),
                             position="rope", scan_layers=scan,
                             attention=dict(sliding_window=4, local_rope_theta=100.0))
    jaxpr = jax.make_jaxpr(jax.grad(_loss(graphdef)))(state).jaxpr
    assert _depths(jaxpr, "sin") == [0, 0]
    assert _depths(jaxpr, "cos") == [0, 0]
