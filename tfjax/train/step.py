"""The pure train and eval steps (`make_train_step`, `make_eval_step`):
`(state, batch) -> (state, metrics)`.

`state` is a dict pytree {step, params, opt, rest} (with LoRA, `params` are the
adapters and `frozen` the base); the model's `graphdef` is closed over, so the trainer
jits the steps with in/out shardings and donated state. Microbatches
(`train.microbatches`) give the same update as one batch; with `local_axes`
(`local_gradient_axes`) each device computes its rows' gradients and one `psum` sums
them. `forward_sums` calls the model and sums the loss as the objective says
(`tfjax.train.objectives`). See docs/training.md ("The train step").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from tfjax.config import TrainConfig
from tfjax.nn.moe import balance_experts, moe_aux
from tfjax.parallel.sharding import shard, use_rules
from tfjax.train.objectives import OBJECTIVES, Objective, bound_objective

__all__ = ["changes_state", "forward_sums", "local_gradient_axes", "make_eval_step",
           "make_train_step"]


def forward_sums(graphdef, params, rest, batch, objective: Objective | None = None,
                 loss_chunk: int = 0, reference=None) -> tuple[dict[str, jax.Array], Any]:
    """Run the model on a batch as `objective` says (default causal_lm; `loss_chunk`:
    `train.loss_chunk`; `reference`: the frozen model, `tfjax.train.reference`, for the
    objectives that compare with one); return the loss sums and the model's updated
    non-param state."""
    # Fresh Variables in this trace: `rest` (RNG counters, MoE statistics) enters from
    # outside value_and_grad, and nnx transforms inside the model (scan) refuse
    # Variables of another trace level.
    rest = jax.tree.map(lambda x: x, rest)
    model = nnx.merge(graphdef, params, rest)
    objective = objective or OBJECTIVES.get("causal_lm")
    if reference is None:
        sums = objective.forward(model, batch, loss_chunk)
    else:
        sums = objective.forward(model, batch, loss_chunk, reference=reference)
    # MoE load-balancing + router z-losses (already weighted; 0 without MoE layers),
    # as a sum over tokens so microbatches add up like the other sums.
    sums["moe_aux"] = moe_aux(model)["aux_loss"] * sums["tokens"]
    # multi-token prediction (already weighted; 0 without MTP modules)
    sums.setdefault("mtp", jnp.zeros((), jnp.float32))
    return sums, nnx.state(model, nnx.Not(nnx.Param))


def _constrain(batch):
    """Token rows on ("batch", "length"); media (audio features `[B, n_mels, frames]`)
    on the batch axes only."""
    return {k: shard(v, ("batch", "length")[:v.ndim] if v.ndim <= 2
                     else ("batch",) + (None,) * (v.ndim - 1)) for k, v in batch.items()}


def local_gradient_axes(mesh, rules, state_shardings) -> tuple[str, ...]:
    """The mesh axes over which `make_train_step` may compute gradients locally and sum
    them once (docs/training.md, "local gradients"): the batch axes of size > 1 when the
    mesh is a CPU one, every other axis has size 1 and every state array is
    replicated; else () (GSPMD alone: on accelerators its per-layer all-reduces
    overlap the backward). The forward must also leave the model's other state as it
    is (`changes_state`)."""
    if mesh is None or mesh.devices.flat[0].platform != "cpu":
        return ()
    batch = [a for a in (dict(rules).get("batch") or ()) if mesh.shape[a] > 1]
    if not batch or any(n > 1 for a, n in mesh.shape.items() if a not in batch):
        return ()
    if not all(sh.is_fully_replicated for sh in jax.tree.leaves(state_shardings)):
        return ()
    return tuple(batch)


def changes_state(graphdef, params, rest, batch_shapes: dict, objective: Objective,
                  loss_chunk: int = 0) -> bool:
    """Whether the forward updates the model's non-parameter state `rest` (dropout's
    draws advance its RNG counters; MoE statistics), read from its jaxpr: a leaf the
    forward does not touch leaves it as the variable it entered as. Local gradients
    need an untouched state: per-device dropout masks would not be the rows of the
    global one, and statistics would need their own reduction."""
    if not jax.tree.leaves(rest):
        return False
    batch = {k: jax.ShapeDtypeStruct(s, jnp.int32) for k, s in batch_shapes.items()}

    def forward(params, rest, batch):
        return forward_sums(graphdef, params, rest, batch, objective, loss_chunk)[1]

    jaxpr = jax.make_jaxpr(forward)(params, rest, batch).jaxpr
    n, m = len(jax.tree.leaves(params)), len(jax.tree.leaves(rest))
    entered = jaxpr.invars[n:n + m]
    return len(jaxpr.outvars) != m or any(o is not i for o, i in zip(jaxpr.outvars, entered))


def _loss(objective: Objective, sums, denom, z_loss: float):
    """The loss of summed terms: (nll + z + MoE aux + MTP) / denom, or for an objective
    with `terms` the sum of each term over its count (`denom`: their global counts)."""
    if objective.terms is None:
        return (sums["nll"] + z_loss * sums["z"] + sums["moe_aux"] + sums["mtp"]) / denom
    return sum(sums[k] / denom[c] for k, c in objective.terms) + (
        sums["moe_aux"] + sums["mtp"]) / denom["tokens"]


def make_train_step(graphdef, tx: optax.GradientTransformation, cfg: TrainConfig,
                    mesh=None, rules=(), merge: Callable | None = None,
                    local_axes: tuple[str, ...] = (), reference=None) -> Callable:
    """A pure `train_step(state, batch) -> (state, metrics)` (not yet jitted). With
    `merge` (LoRA, `tfjax.train.lora`), `state["params"]` are the trainable adapters
    and the model computes with `merge(state["frozen"], params)`: the frozen base gets
    no gradient and no update. `local_axes` (`local_gradient_axes`): compute the
    gradients per device over these mesh axes and sum them once. `reference`
    (`tfjax.train.reference.Reference`): the frozen model the objective compares with."""
    M = cfg.microbatches
    objective = bound_objective(cfg.objective, cfg)

    def loss_fn(params, rest, batch, denom, frozen, ref_parts=None):
        # the frozen base enters from outside value_and_grad, like `rest` (forward_sums)
        full = params if merge is None else merge(jax.tree.map(lambda x: x, frozen), params)
        ref = None if reference is None else reference.model(*ref_parts)
        sums, rest = forward_sums(graphdef, full, rest, batch, objective, cfg.loss_chunk, ref)
        return _loss(objective, sums, denom, cfg.z_loss), (sums, rest)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, rest, batch, denom, frozen, ref_parts=None):
        """(grads, sums, rest) over `batch`, its microbatches accumulated."""
        if M == 1:
            (_, (sums, rest)), grads = grad_fn(params, rest, batch, denom, frozen, ref_parts)
            return grads, sums, rest
        B = batch["mask"].shape[0]
        micro = jax.tree.map(lambda x: x.reshape(B // M, M, *x.shape[1:]).swapaxes(0, 1), batch)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zsums = {k: jnp.zeros((), jnp.float32)
                 for k in ("nll", "z", "tokens", "bytes", "moe_aux", "mtp", *objective.extra)}

        def body(carry, mb):
            acc, rest, tot = carry
            mb = _constrain(mb)
            (_, (sums, rest)), g = grad_fn(params, rest, mb, denom, frozen, ref_parts)
            acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
            tot = {k: tot[k] + sums[k] for k in tot}
            return (acc, rest, tot), None

        (grads, rest, sums), _ = jax.lax.scan(body, (zeros, rest, zsums), micro)
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), sums, rest

    def local_gradients(params, rest, batch, denom, frozen):
        """`gradients` per device over `local_axes` (each its own rows: microbatch i
        of a device is its rows of the global microbatch i), summed once."""
        def local(params, rest, batch, denom, frozen):
            with use_rules(None, ()):  # inside: no mesh axes to constrain to
                grads, sums, rest = gradients(params, rest, batch, denom, frozen)
            return jax.lax.psum((grads, sums), local_axes) + (rest,)

        rows = jax.tree.map(lambda _: P(local_axes), batch)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), rows, P(), P()),
                             out_specs=(P(), P(), P()), check_vma=False)(
                                 params, rest, batch, denom, frozen)

    def train_step(state, batch):
        with use_rules(mesh, rules) if mesh is not None else _nullcontext():
            batch = _constrain(batch)
            params, rest, frozen = state["params"], state["rest"], state.get("frozen")
            if objective.terms is None:
                denom = jnp.maximum(batch["mask"].astype(jnp.float32).sum(), 1.0)
            else:  # each term over its global count (pairs, scored tokens)
                denom = {k: jnp.maximum(v, 1.0) for k, v in objective.counts(batch).items()}
            if reference is None:
                grads, sums, rest = (local_gradients if local_axes else gradients)(
                    params, rest, batch, denom, frozen)
            else:  # never with local gradients (`build_program`)
                grads, sums, rest = gradients(params, rest, batch, denom, frozen,
                                              reference.parts(state))
            grad_norm = optax.global_norm(grads)
            updates, opt = tx.update(grads, state["opt"], params)
            params = optax.apply_updates(params, updates)
            rest = balance_experts(rest)  # MoE aux-loss-free balancing (a no-op without)
            new = dict(state, step=state["step"] + 1, params=params, opt=opt, rest=rest)
            loss = (sums["nll"] / jnp.maximum(sums["tokens"], 1.0) if objective.terms is None
                    else _loss(objective, sums, {c: jnp.maximum(sums[c], 1.0)
                                                 for _, c in objective.terms}, 0.0))
            metrics = dict(loss=loss,
                           z=sums["z"] / jnp.maximum(sums["tokens"], 1.0),
                           moe_aux=sums["moe_aux"] / jnp.maximum(sums["tokens"], 1.0),
                           mtp=sums["mtp"] / jnp.maximum(sums["tokens"], 1.0),
                           nll_sum=sums["nll"], tokens=sums["tokens"], bytes=sums["bytes"],
                           grad_norm=grad_norm, **{k: sums[k] for k in objective.extra})
            return new, metrics

    return train_step


def make_eval_step(graphdef, mesh=None, rules=(), objective: str = "causal_lm",
                   merge: Callable | None = None, loss_chunk: int = 0,
                   reference=None, train: TrainConfig | None = None) -> Callable:
    """A pure `eval_step(state, batch) -> sums` (nll, z, tokens, bytes, and the
    objective's `extra` sums); `merge` and `reference` as for `make_train_step`,
    `loss_chunk` is `train.loss_chunk`; `train`: the run's train section (the
    objectives whose forward reads it)."""
    obj = bound_objective(objective, train)

    def eval_step(state, batch):
        with use_rules(mesh, rules) if mesh is not None else _nullcontext():
            params = state["params"] if merge is None else merge(state["frozen"],
                                                                 state["params"])
            ref = None if reference is None else reference.model(*reference.parts(state))
            sums, _ = forward_sums(graphdef, params, state["rest"], _constrain(batch), obj,
                                   loss_chunk, ref)
            return sums

    return eval_step


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
