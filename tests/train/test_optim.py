"""Optimizers (`train.optimizer`), schedules, param groups: each optimizer learns, Muon
orthogonalises matrices only and per layer / expert, the WSD schedule's values, groups
change lr and weight decay of the matched parameters exactly, bad input names the
field, and every optimizer resumes bitwise."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_decoder
from flax import nnx
from tiny_setup import devices, preempt_after, tiny_config

from tfjax import config as C
from tfjax.train import Trainer
from tfjax.train.optim import OPTIMIZERS, lr_schedule, make_optimizer, muon_dims

OPTIMIZER_NAMES = ("adamw", "muon", "adafactor", "lion", "sgd")


class Params(nnx.Module):
    """Parameters of every kind Muon must tell apart, with their logical axes."""

    def __init__(self, rng):
        def p(names, *shape):
            return nnx.Param(jnp.asarray(rng.normal(size=shape), jnp.float32), out_sharding=names)
        self.embedding = p(("vocab", "embed"), 11, 8)
        self.head = p(("embed", "vocab"), 8, 11)
        self.norm = p(("layers", "norm"), 3, 8)
        self.bias = p(("layers", "heads", "head_dim"), 3, 2, 4)
        self.w = p(("embed", "mlp"), 8, 12)
        self.stacked = p(("layers", "embed", "mlp"), 3, 8, 12)
        self.q = p(("layers", "embed", "heads", "head_dim"), 3, 8, 2, 4)
        self.o = p(("layers", "heads", "head_dim", "embed"), 3, 2, 4, 8)
        self.experts = p(("expert", "mlp", "embed"), 4, 12, 8)
        self.router = p(("embed", None), 8, 4)


def _params(seed=0):
    with nnx.use_eager_sharding(False):
        return nnx.state(Params(np.random.default_rng(seed)), nnx.Param)


def _grads(params, seed=1):
    """Ill-conditioned gradients: singular values spread over two decades."""
    rng = np.random.default_rng(seed)

    def one(v):
        x = rng.normal(size=v.shape) * np.logspace(0, -2, v.shape[-1])
        return v.replace(jnp.asarray(x, jnp.float32))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _update(cfg, params, grads, steps=1):
    tx = make_optimizer(cfg)
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grads, state, params)
    return {k: np.asarray(v.get_value()) for k, v in updates.items()}


def test_every_optimizer_learns_a_tiny_model():
    cfg = tiny_config()
    with nnx.use_eager_sharding(False):
        model = tiny_decoder.build(cfg.model, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 259)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    assert OPTIMIZERS.names() == tuple(sorted(OPTIMIZER_NAMES))
    for name in OPTIMIZER_NAMES:
        t = C.TrainConfig(optimizer=name, steps=10, warmup_steps=0, adafactor_min_dim=16,
                          lr=0.5 if name == "sgd" else 3e-2)
        tx = make_optimizer(t)

        @jax.jit
        def step(p, s):
            value, g = jax.value_and_grad(loss)(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value

        p, s, losses = params, tx.init(params), []
        for _ in range(5):
            p, s, value = step(p, s)
            losses.append(float(value))
        assert losses[-1] < losses[0] - 0.3, (name, losses)


def test_muon_orthogonalises_matrices_per_layer_and_expert_and_adamw_takes_the_rest():
    params, cfg = _params(), C.TrainConfig(optimizer="muon", warmup_steps=0, weight_decay=0.0,
                                           lr=1.0, schedule="constant", grad_clip=0.0)
    grads = _grads(params)
    up = _update(cfg, params, grads)
    # which parameters are matrices, and how each is read as [fan_in, fan_out]
    dims = {k: muon_dims(v) for k, v in params.items()}
    assert {k for k, d in dims.items() if d is not None} == {"w", "stacked", "q", "o", "experts"}
    assert tuple(dims["q"]) == ((1,), (2, 3)) and tuple(dims["o"]) == ((1, 2), (3,))
    assert tuple(dims["experts"]) == ((1,), (2,))

    # a 2-D matrix: the update is -lr * 0.2 * sqrt(max(in, out)) * (near-)orthogonal
    def singular_values(u):
        return np.linalg.svd(u / (0.2 * np.sqrt(max(u.shape))), compute_uv=False)
    s = singular_values(-up["w"])
    assert s.min() > 0.5 and s.max() < 1.3, s  # the gradient's span two decades
    g = np.linalg.svd(np.asarray(grads["w"].get_value()), compute_uv=False)
    assert g.max() / g.min() > 20
    # stacked layers: each layer's matrix on its own, equal to Muon on that slice alone
    for i in range(3):
        one = _params()
        one = nnx.State({"w": one["w"].replace(params["stacked"].get_value()[i])})
        g1 = nnx.State({"w": grads["w"].replace(grads["stacked"].get_value()[i])})
        np.testing.assert_allclose(up["stacked"][i], _update(cfg, one, g1)["w"], rtol=1e-5,
                                   atol=1e-6)
        assert singular_values(-up["stacked"][i]).min() > 0.5
    # q [D, N, H] is the matrix [D, N*H] of each layer; experts [E, F, D] one per expert
    q = up["q"][1].reshape(8, 8)
    assert singular_values(-q).min() > 0.5 and singular_values(-q).max() < 1.3
    for e in range(4):
        s = singular_values(-up["experts"][e])
        assert s.min() > 0.5 and s.max() < 1.3
    # embeddings, the head, norms, biases and the router follow AdamW exactly
    adam = optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.0)
    ref, _ = adam.update(grads, adam.init(params), params)
    for k in ("embedding", "head", "norm", "bias", "router"):
        np.testing.assert_allclose(up[k], np.asarray(ref[k].get_value()), rtol=1e-6)


def test_wsd_and_linear_schedules():
    def at(steps, **kw):
        f = lr_schedule(C.TrainConfig(steps=100, lr=1.0, warmup_steps=10, lr_min_ratio=0.1, **kw))
        return [float(f(s)) for s in steps]

    key = (0, 9, 10, 79, 80, 90, 100)
    np.testing.assert_allclose(at(key, schedule="wsd", decay_fraction=0.2),
                               [0.1, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1], rtol=1e-6)
    np.testing.assert_allclose(at(key, schedule="wsd", decay_fraction=0.2, decay_shape="cosine"),
                               [0.1, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1], rtol=1e-6)
    np.testing.assert_allclose(at((85,), schedule="wsd", decay_shape="cosine"),
                               [0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 4))], rtol=1e-6)
    np.testing.assert_allclose(at((85, 100), schedule="wsd", decay_shape="1-sqrt"),
                               [0.1 + 0.9 * (1 - np.sqrt(0.25)), 0.1], rtol=1e-6)
    np.testing.assert_allclose(at((0, 10, 99), schedule="wsd", decay_fraction=0.0), [0.1, 1, 1])
    np.testing.assert_allclose(at((10, 55, 100), schedule="linear"), [1.0, 0.55, 0.1], rtol=1e-6)


def test_param_groups_change_lr_and_weight_decay_exactly():
    """SGD without momentum: update = -lr * mult * (g + wd * p) on each group's
    parameters, and the default (wd on matrices only) on the rest."""
    params = _params()
    grads = _grads(params)
    base = dict(optimizer="sgd", momentum=0.0, lr=0.1, schedule="constant", warmup_steps=0,
                grad_clip=0.0, weight_decay=0.01)
    up = _update(C.TrainConfig(**base, param_groups="embedding:lr=0.5,wd=0;@norm:lr=2,wd=0.3;"
                               "@mlp:lr=3"), params, grads)
    p = {k: np.asarray(v.get_value()) for k, v in params.items()}
    g = {k: np.asarray(v.get_value()) for k, v in grads.items()}
    want = {
        "embedding": -0.1 * 0.5 * g["embedding"],  # wd=0
        "norm": -0.1 * 2 * (g["norm"] + 0.3 * p["norm"]),  # wd even on a norm, as asked
        "w": -0.1 * 3 * (g["w"] + 0.01 * p["w"]),  # first group with @mlp: default wd
        "stacked": -0.1 * 3 * (g["stacked"] + 0.01 * p["stacked"]),
        "experts": -0.1 * 3 * (g["experts"] + 0.01 * p["experts"]),
        "head": -0.1 * (g["head"] + 0.01 * p["head"]),  # no group: default
        "router": -0.1 * (g["router"] + 0.01 * p["router"]),
        # a [heads, head_dim] bias has 2 logical axes besides "layers": `decay_mask`
        # decays it like a matrix (Muon does not take it: no "embed")
        "bias": -0.1 * (g["bias"] + 0.01 * p["bias"]),
    }
    for k, v in want.items():
        np.testing.assert_allclose(up[k], v, rtol=1e-6, err_msg=k)
    # AdamW: a group's update is AdamW at its lr and weight decay (to float rounding:
    # optax.masked itself moves the last bit)
    adamw = dict(base, optimizer="adamw")
    up = _update(C.TrainConfig(**adamw, param_groups="head:lr=0.5,wd=0.5"), params, grads, 2)
    ref = _update(C.TrainConfig(**dict(adamw, lr=0.05, weight_decay=0.5)), params, grads, 2)
    plain = _update(C.TrainConfig(**adamw), params, grads, 2)
    np.testing.assert_allclose(up["head"], ref["head"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(up["head"], plain["head"], rtol=1e-2)
    for k in ("embedding", "w", "norm", "q"):
        np.testing.assert_allclose(up[k], plain[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("values,message", [
    (dict(optimizer="adam"), "unknown train.optimizer='adam'; allowed: adafactor, adamw, lion, "
                             "muon, sgd"),
    (dict(param_groups="embed:lr=0.5;@nope:wd=0"), "train.param_groups: group '@nope' matches no "
                                                    "parameter"),
])
def test_names_fail_before_compiling(tmp_path, values, message):
    cfg = tiny_config(train=values, mesh=dict(data=1))
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(cfg, str(tmp_path), build_model=tiny_decoder.build, devices=devices(1),
                log=lambda s: None)


@pytest.mark.parametrize("values,message", [
    (dict(schedule="step"), "train.schedule: got 'step'; allowed: 'cosine', 'constant', 'linear', "
                            "'wsd'"),
    (dict(decay_shape="exp"), "train.decay_shape: got 'exp'; allowed: 'linear', 'cosine', '1-sqrt'"),
    (dict(decay_fraction=1.5), "train.decay_fraction: must be in [0, 1]"),
    (dict(param_groups="embed"), "train.param_groups: group 'embed' has no 'PATTERN:'"),
    (dict(param_groups="embed:lr"), "train.param_groups: group 'embed:lr': 'lr' is not lr=X or wd=X"),
    (dict(param_groups="embed:beta=2"), "train.param_groups: group 'embed:beta=2': 'beta=2' is not"),
    (dict(param_groups="embed:lr=x"), "train.param_groups: group 'embed:lr=x': lr='x' is not a "
                                      "number"),
    (dict(param_groups="a:lr=1;a:wd=0"), "train.param_groups: pattern 'a' appears twice"),
    (dict(optimizer="sgd", momentum=0.0, nesterov=True), "train.nesterov: Nesterov momentum needs"),
    (dict(muon_beta=1.0), "train.muon_beta: must be in [0, 1)"),
    (dict(optimizr="sgd"), "train.optimizr: unknown field (did you mean optimizer?"),
])
def test_config_errors_name_the_field(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        C.from_dict(C.RunConfig, {"train": values}).validate()


@pytest.mark.parametrize("optimizer,extra", [
    ("adamw", dict(param_groups="embed:lr=0.5,wd=0;@norm:lr=2")),
    ("muon", {}), ("adafactor", dict(adafactor_min_dim=16)), ("lion", {}),
    ("sgd", dict(nesterov=True, lr=0.3)),
])
def test_every_optimizer_resumes_exactly(tmp_path, optimizer, extra):
    """Killed after step 2 and resumed equals the run that went through, bit for bit,
    with the optimizer state sharded over fsdp=2 (Adafactor's row / column statistics
    replicated)."""
    sections = dict(train=dict(steps=4, optimizer=optimizer, **extra), mesh=dict(data=1, fsdp=2),
                    checkpoint=dict(enabled=True, every_steps=2, keep=2))
    cfg = tiny_config(**sections)

    def trainer(name):
        return Trainer(cfg, str(tmp_path / name), build_model=tiny_decoder.build,
                       devices=devices(2), log=lambda s: None)

    straight = trainer("full")
    full = straight.train()
    tr = trainer("killed")
    preempt_after(tr, 2)
    assert tr.train()["step"] == 2
    tr2 = trainer("killed")
    resumed = tr2.train()
    assert sorted(resumed["history"]) == [3, 4]
    for k in (3, 4):
        assert resumed["history"][k] == full["history"][k]
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                        straight.state["params"], tr2.state["params"])
    assert all(jax.tree.leaves(same))
    assert os.listdir(tmp_path / "killed" / "checkpoints")
