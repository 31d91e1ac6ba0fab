"""Optimizers and learning-rate schedules through optax: one record (`Optimizer`) per
`train.optimizer` in `OPTIMIZERS` (adamw, muon, adafactor, lion, sgd), global-norm
clipping first, decoupled weight decay on matrices (`decay_mask`), and learning-rate /
weight-decay groups by parameter name (`train.param_groups`, `param_labels`).
`make_optimizer` builds the optax transformation and `lr_schedule` the schedule;
`muon_dims` says which parameters Muon orthogonalises, as which matrix; `scale_by_mup`
is μP's per-class learning rate. See docs/training.md ("Optimizers and schedules").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from tfjax.config import ModelConfig, ParamGroup, TrainConfig, parse_param_groups
from tfjax.models import mup
from tfjax.parallel.rules import variable_axes
from tfjax.registry import Registry

__all__ = ["MUP_OPTIMIZERS", "OPTIMIZERS", "Optimizer", "decay_mask", "lr_schedule",
           "make_optimizer", "muon_dims", "param_labels", "scale_by_mup"]

STACK_AXES = ("layers", "expert")  # stacked copies: one matrix per index
MODEL_AXES = ("embed", "latent")  # a Muon matrix maps into or out of one of these
TABLE_AXES = ("vocab", "max_len", "relpos_buckets", "type_vocab", "classes")
MUP_OPTIMIZERS = ("adamw", "adafactor", "lion")  # whose lr μP's Adam rules scale


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then to `lr * lr_min_ratio` at
    step `steps`: cosine, linear, constant (no decay), or wsd (constant until the last
    `decay_fraction` of `steps`, then `decay_shape`: linear, cosine or 1-sqrt)."""
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(cfg.steps - warmup, 1)
    r = cfg.lr_min_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.lr * jnp.minimum((step + 1.0) / max(warmup, 1), 1.0) if warmup else cfg.lr
        if cfg.schedule == "constant":
            return jnp.asarray(warm, jnp.float32)
        if cfg.schedule == "cosine":
            frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
            cos = r + (1 - r) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
            return jnp.where(step < warmup, warm, cfg.lr * cos).astype(jnp.float32)
        if cfg.schedule == "linear":
            frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
            return jnp.where(step < warmup, warm, cfg.lr * (1 - (1 - r) * frac)).astype(
                jnp.float32)
        # wsd: the decay takes the last decay_fraction of the steps (never the warmup)
        start = max(cfg.steps - round(cfg.decay_fraction * cfg.steps), warmup)
        frac = jnp.clip((step - start) / max(cfg.steps - start, 1), 0.0, 1.0)
        shape = {"linear": lambda f: 1 - f, "cosine": lambda f: 0.5 * (1 + jnp.cos(jnp.pi * f)),
                 "1-sqrt": lambda f: 1 - jnp.sqrt(f)}[cfg.decay_shape](frac)
        return jnp.where(step < warmup, warm, cfg.lr * (r + (1 - r) * shape)).astype(jnp.float32)

    return schedule


def _value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _decays(x) -> bool:
    names = variable_axes(x)
    if names is not None:
        return len([n for n in names if n != "layers"]) >= 2
    return getattr(_value(x), "ndim", 0) >= 2


def _label_tree(f: Callable[[Any], Any], tree):
    """`f(leaf)` for every parameter of `tree` (Variables keep their wrapper)."""
    return jax.tree.map(lambda x: x.replace(f(x)) if _is_var(x) else f(x), tree, is_leaf=_is_var)


def decay_mask(params):
    """Tree of bools (Variables keep their wrapper): True where weight decay applies."""
    return _label_tree(_decays, params)


def muon_dims(x) -> MuonDimensionNumbers | None:
    """How Muon sees parameter `x` (a Variable or an array): None when it is not a
    matrix (AdamW's), else its input (reduction) and output axes; the other axes,
    "layers" and "expert", are batch axes (one matrix per index)."""
    names = variable_axes(x)
    if names is None:
        return MuonDimensionNumbers(0, 1) if getattr(_value(x), "ndim", 0) == 2 else None
    core = [i for i, n in enumerate(names) if n not in STACK_AXES]
    model = [i for i in core if names[i] in MODEL_AXES]
    if (len(core) < 2 or not model or any(n in TABLE_AXES for n in names)
            or not any(names[i] is not None for i in core if i != model[0])):
        return None
    if names[core[0]] in MODEL_AXES:  # embed / latent first: the input
        return MuonDimensionNumbers(tuple(core[:1]), tuple(core[1:]))
    if names[core[-1]] in MODEL_AXES:  # ... last: the output
        return MuonDimensionNumbers(tuple(core[:-1]), tuple(core[-1:]))
    return MuonDimensionNumbers(tuple(core[:1]), tuple(core[1:]))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def param_labels(groups: tuple[ParamGroup, ...], params) -> Any:
    """Which of `train.param_groups` each parameter is in: "group<i>" for the first
    group whose pattern matches it, "other" for none. Pattern "@AXIS" matches a
    parameter that has logical axis AXIS; any other pattern one whose path (its keys
    joined by "/", e.g. "embed/tokens/embedding") contains it. A group that matches
    no parameter (left to it by the groups before) is a ValueError."""
    used: set[int] = set()

    def label(path, x):
        axes = variable_axes(x) or ()
        where = _path(path)
        for i, g in enumerate(groups):
            hit = g.pattern[1:] in axes if g.pattern.startswith("@") else g.pattern in where
            if hit:
                used.add(i)
                return f"group{i}"
        return "other"

    labels = jax.tree_util.tree_map_with_path(
        lambda p, x: x.replace(label(p, x)) if _is_var(x) else label(p, x), params,
        is_leaf=_is_var)
    for i, g in enumerate(groups):
        if i not in used:
            leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
            paths = [_path(p) for p, _ in leaves]
            axes = sorted({n for _, x in leaves for n in (variable_axes(x) or ()) if n})
            raise ValueError(
                f"train.param_groups: group {g.pattern!r} matches no parameter"
                f"{' that an earlier group left' if used else ''}; a pattern is a piece of a "
                f"path ({', '.join(paths[:3])}, ...) or @AXIS for a logical axis "
                f"({', '.join('@' + a for a in axes)})")
    return labels


# --------------------------------------------------------------- optimizers
@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One `train.optimizer`: `build(cfg, lr, weight_decay, mask)` -> the optax
    transformation after clipping; `lr` a schedule, `mask` the weight-decay mask
    (None: decay every parameter it is given)."""

    build: Callable[[TrainConfig, optax.Schedule, float, Any], optax.GradientTransformation]
    summary: str


def _adamw(cfg, lr, wd, mask):
    return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask)


def _muon_dims_tree(updates):
    """Muon's weight_dimension_numbers: each matrix's, MaskedNode left in place."""
    def one(x):
        if isinstance(_value(x), optax.MaskedNode):
            return x
        return x.replace(muon_dims(x)) if _is_var(x) else muon_dims(x)
    return jax.tree.map(one, updates, is_leaf=lambda x: _is_var(x) or isinstance(
        x, optax.MaskedNode))


def _scale_by_shape(rms: float) -> optax.GradientTransformation:
    """Muon's update scale per matrix: sqrt(max(fan_in, fan_out)) * rms (update RMS ~
    rms, AdamW's), or sqrt(max(1, fan_out / fan_in)) when rms is 0."""
    def one(x):
        u = _value(x)
        if isinstance(u, optax.MaskedNode):
            return x
        d = muon_dims(x)
        fan_in = math.prod(u.shape[a] for a in d.reduction_axis)
        fan_out = math.prod(u.shape[a] for a in d.output_axis)
        s = math.sqrt(max(fan_in, fan_out)) * rms if rms else math.sqrt(max(1, fan_out / fan_in))
        return x.replace(u * s) if _is_var(x) else u * s

    def update(updates, state, params=None):
        return jax.tree.map(one, updates, is_leaf=lambda x: _is_var(x) or isinstance(
            x, optax.MaskedNode)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _muon_labels(params):
    def label(x):
        if isinstance(_value(x), optax.MaskedNode):
            return "adamw"
        return "muon" if muon_dims(x) is not None else "adamw"
    return _label_tree(label, params)


def _muon(cfg, lr, wd, mask):
    matrices = optax.chain(
        scale_by_muon(ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta,
                      nesterov=cfg.muon_nesterov, weight_dimension_numbers=_muon_dims_tree),
        _scale_by_shape(cfg.muon_rms),
        optax.add_decayed_weights(wd),  # every Muon parameter is a matrix
        optax.scale_by_learning_rate(lr))
    return optax.partition({"muon": matrices, "adamw": _adamw(cfg, lr, wd, mask)}, _muon_labels)


def _unboxed(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` on plain arrays: its state may hold arrays of other shapes than the
    parameters (Adafactor's row / column statistics), which must not carry the
    parameters' logical axes. A state array with its parameter's shape takes the
    parameter's Variable back (and so its sharding); the rest is replicated."""
    def unbox(tree):
        return jax.tree.map(_value, tree, is_leaf=_is_var)

    def rebox_state(state, params):
        plain = jax.tree.structure(unbox(params))

        def walk(node):
            if jax.tree.structure(node) == plain:
                return jax.tree.map(
                    lambda p, s: p.replace(s) if _is_var(p) and getattr(
                        _value(p), "shape", None) == getattr(s, "shape", ()) else s,
                    params, node, is_leaf=_is_var)
            if isinstance(node, tuple) and hasattr(node, "_fields"):
                return type(node)(*map(walk, node))
            if isinstance(node, tuple):
                return tuple(map(walk, node))
            return node
        return walk(state)

    def init(params):
        return rebox_state(inner.init(unbox(params)), params)

    def update(updates, state, params=None):
        new, state = inner.update(unbox(updates), unbox(state), unbox(params))
        new = jax.tree.map(lambda u, n: u.replace(n) if _is_var(u) else n, updates, new,
                           is_leaf=_is_var)
        return new, rebox_state(state, params)

    return optax.GradientTransformation(init, update)


def _adafactor(cfg, lr, wd, mask):
    parts = [optax.scale_by_factored_rms(decay_rate=cfg.adafactor_decay,
                                         min_dim_size_to_factor=cfg.adafactor_min_dim)]
    if cfg.adafactor_clip:
        parts.append(optax.clip_by_block_rms(cfg.adafactor_clip))
    return optax.chain(_unboxed(optax.chain(*parts)), optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


def _lion(cfg, lr, wd, mask):
    return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask)


def _sgd(cfg, lr, wd, mask):
    parts = [optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov)] if cfg.momentum else []
    return optax.chain(*parts, optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


OPTIMIZERS: Registry[Optimizer] = Registry("optimizer", {
    "adamw": Optimizer(_adamw, "AdamW (b1, b2, eps)"),
    "muon": Optimizer(_muon, "Muon for matrices (muon_*), AdamW for the rest"),
    "adafactor": Optimizer(_adafactor, "Adafactor (adafactor_*)"),
    "lion": Optimizer(_lion, "Lion (b1, b2)"),
    "sgd": Optimizer(_sgd, "SGD (momentum, nesterov)"),
})


def make_optimizer(cfg: TrainConfig, model: ModelConfig | None = None
                   ) -> optax.GradientTransformation:
    """Clipping, then `train.optimizer` with the schedule; with `train.param_groups`,
    one copy of the optimizer per group (`optax.partition`, labels `param_labels`) at
    its lr multiple and weight decay; with μP (`model.mup_base_width`), each update
    times its parameter class's lr multiplier (`scale_by_mup`). Unknown names and
    malformed groups fail here, a group that matches no parameter at `init` (both
    before anything compiles)."""
    opt = OPTIMIZERS.get(cfg.optimizer, field="train.optimizer")
    groups = parse_param_groups(cfg.param_groups)
    schedule = lr_schedule(cfg)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    if model is not None and model.mup_base_width:
        if cfg.optimizer not in MUP_OPTIMIZERS:
            raise ValueError(
                f"train.optimizer: μP (model.mup_base_width) scales Adam-type learning rates "
                f"({', '.join(MUP_OPTIMIZERS)}), not {cfg.optimizer!r}; choose one of those "
                f"or set model.mup_base_width=0")
        mup_tail = [scale_by_mup(mup.width_multiplier(model))]
    else:
        mup_tail = []
    if not groups:
        parts.append(opt.build(cfg, schedule, cfg.weight_decay, decay_mask))
        return optax.chain(*parts, *mup_tail)
    txs = {"other": opt.build(cfg, schedule, cfg.weight_decay, decay_mask)}
    for i, g in enumerate(groups):
        lr = schedule if g.lr is None else (lambda s, m=g.lr: schedule(s) * m)
        wd, mask = (cfg.weight_decay, decay_mask) if g.wd is None else (g.wd, None)
        txs[f"group{i}"] = opt.build(cfg, lr, wd, mask)
    parts.append(optax.partition(txs, lambda params: param_labels(groups, params)))
    return optax.chain(*parts, *mup_tail)


def scale_by_mup(m: float) -> optax.GradientTransformation:
    """Each update times its parameter's μP learning-rate multiplier at width
    multiplier `m` (`tfjax.models.mup.lr_multiplier`: hidden and router matrices
    1/m); after the optimizer, so the decoupled weight decay scales with its lr."""
    def one(x):
        c = mup.lr_multiplier(mup.classify(x), m)
        return x if c == 1.0 else x.replace(x.get_value() * c)

    def update(updates, state, params=None):
        return jax.tree.map(one, updates, is_leaf=_is_var), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
