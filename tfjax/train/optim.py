"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask.

Weight decay applies to matrices (parameters with >= 2 logical axes other than
"layers", so stacked scanned layers count per layer) and not to norm scales and
biases. Clipping comes first, so the reported grad norm is the unclipped one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tfjax.config import TrainConfig
from tfjax.parallel.rules import variable_axes

__all__ = ["decay_mask", "lr_schedule", "make_optimizer"]


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine to `lr * lr_min_ratio`
    at step `steps` (or constant after warmup)."""
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(cfg.steps - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.lr * jnp.minimum((step + 1.0) / max(warmup, 1), 1.0) if warmup else cfg.lr
        if cfg.schedule == "constant":
            return jnp.asarray(warm, jnp.float32)
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        cos = cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < warmup, warm, cfg.lr * cos).astype(jnp.float32)

    return schedule


def _decays(x) -> bool:
    names = variable_axes(x)
    if names is not None:
        return len([n for n in names if n != "layers"]) >= 2
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    return getattr(value, "ndim", 0) >= 2


def decay_mask(params):
    """Tree of bools (Variables keep their wrapper): True where weight decay applies."""
    return jax.tree.map(lambda x: x.replace(_decays(x)) if isinstance(x, nnx.Variable) else _decays(x),
                        params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
