"""The pure train and eval steps: `(state, batch) -> (state, metrics)`.

`state` is a plain dict pytree {step, params, opt, rest}: `params` are the
model's `nnx.Param`s, `rest` its other state (e.g. dropout RNG counters), `opt`
the optax state. The model's structure (`graphdef`) is static and closed over,
so the trainer can `jax.jit` these with in/out shardings and donate `state`.

Activation checkpointing lives in the model (`model.remat`, per scanned layer).
Gradient accumulation scans over `microbatches` slices of the batch and sums
gradients of *sums* of token losses divided by the token count of the whole
batch, so any number of microbatches gives the same update as one.
Microbatch i takes rows i, i+M, i+2M, ... so every device keeps its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tfjax.config import TrainConfig
from tfjax.nn.moe import moe_aux
from tfjax.parallel.sharding import shard, use_rules
from tfjax.train.losses import cross_entropy_sums

__all__ = ["forward_sums", "make_eval_step", "make_train_step"]


def forward_sums(graphdef, params, rest, batch) -> tuple[dict[str, jax.Array], Any]:
    """Run the model on a batch; return the loss sums and the model's updated non-param state."""
    # Fresh Variables in this trace: `rest` (RNG counters, MoE statistics) enters from
    # outside value_and_grad, and nnx transforms inside the model (scan) refuse
    # Variables of another trace level.
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, params, rest)
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    sums = cross_entropy_sums(logits, batch["targets"], batch["mask"], batch["target_bytes"])
    # MoE load-balancing + router z-losses (already weighted; 0 without MoE layers),
    # as a sum over tokens so microbatches add up like the other sums.
    sums["moe_aux"] = moe_aux(model)["aux_loss"] * sums["tokens"]
    return sums, nnx.state(model, nnx.Not(nnx.Param))


def _constrain(batch):
    return {k: shard(v, ("batch", "length")) for k, v in batch.items()}


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: TrainConfig,
                    mesh=None, rules=()) -> Callable:
    """A pure `train_step(state, batch) -> (state, metrics)` (not yet jitted)."""
    M = cfg.microbatches

    def loss_fn(params, rest, batch, denom):
        sums, rest = forward_sums(graphdef, params, rest, batch)
        loss = (sums["nll"] + cfg.z_loss * sums["z"] + sums["moe_aux"]) / denom
        return loss, (sums, rest)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state, batch):
        with use_rules(mesh, rules) if mesh is not None else _nullcontext():
            batch = _constrain(batch)
            params, rest = state["params"], state["rest"]
            denom = jnp.maximum(batch["mask"].astype(jnp.float32).sum(), 1.0)
            if M == 1:
                (_, (sums, rest)), grads = grad_fn(params, rest, batch, denom)
            else:
                B = batch["inputs"].shape[0]
                micro = jax.tree.map(
                    lambda x: x.reshape(B // M, M, *x.shape[1:]).swapaxes(0, 1), batch)
                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                zsums = {k: jnp.zeros((), jnp.float32)
                         for k in ("nll", "z", "tokens", "bytes", "moe_aux")}

                def body(carry, mb):
                    acc, rest, tot = carry
                    mb = _constrain(mb)
                    (_, (sums, rest)), g = grad_fn(params, rest, mb, denom)
                    acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
                    tot = {k: tot[k] + sums[k] for k in tot}
                    return (acc, rest, tot), None

                (grads, rest, sums), _ = jax.lax.scan(body, (zeros, rest, zsums), micro)
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            grad_norm = optax.global_norm(grads)
            updates, opt = tx.update(grads, state["opt"], params)
            params = optax.apply_updates(params, updates)
            new = dict(step=state["step"] + 1, params=params, opt=opt, rest=rest)
            metrics = dict(loss=sums["nll"] / jnp.maximum(sums["tokens"], 1.0),
                           z=sums["z"] / jnp.maximum(sums["tokens"], 1.0),
                           moe_aux=sums["moe_aux"] / jnp.maximum(sums["tokens"], 1.0),
                           nll_sum=sums["nll"], tokens=sums["tokens"], bytes=sums["bytes"],
                           grad_norm=grad_norm)
            return new, metrics

    return train_step


def make_eval_step(graphdef, mesh=None, rules=()) -> Callable:
    """A pure `eval_step(state, batch) -> sums` (nll, z, tokens, bytes)."""

    def eval_step(state, batch):
        with use_rules(mesh, rules) if mesh is not None else _nullcontext():
            sums, _ = forward_sums(graphdef, state["params"], state["rest"], _constrain(batch))
            return sums

    return eval_step


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
