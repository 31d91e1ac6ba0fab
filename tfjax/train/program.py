"""The compiled-to-be program of a run on a mesh (`build_program`): the abstract
model and its shardings, jitted init / train step / eval step with in/out shardings
and donated state, and the batch layout the steps expect (the objective's keys and
shapes, rows over the batch mesh axes; zig-zag order over the sequence axis when
`zigzag_devices` says so). `tfjax.train.trainer` runs it; `--compile_only` lowers it
for a TPU slice or a GPU host."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tfjax.config import RunConfig
from tfjax.models import FFN_KINDS, LAYER_KINDS, build
from tfjax.nn.quant import check_backend
from tfjax.parallel.rules import logical_rules, replicated, tree_shardings
from tfjax.parallel.sharding import logical_to_spec, use_rules
from tfjax.parallel.zigzag import zigzag_data, zigzag_order
from tfjax.train.lora import Lora, train_state_shape
from tfjax.train.objectives import OBJECTIVES, bound_objective
from tfjax.train.reference import Reference, reference_of
from tfjax.train.step import changes_state, local_gradient_axes, make_eval_step, make_train_step

__all__ = ["Program", "build_program", "zigzag_devices", "zigzag_rows"]


def _axes_size(mesh, rules, name: str) -> tuple[int, tuple[str, ...]]:
    axes = tuple(a for a in (dict(rules).get(name) or ()))
    return math.prod(mesh.shape[a] for a in axes), axes


def zigzag_devices(cfg: RunConfig, mesh, build_model=None) -> tuple[int, str | None]:
    """(n, note): n > 0 when the trainer feeds batches in zig-zag order over the n
    devices of the sequence axis (`model.attention.zigzag="data"`, ring or USP attention, seq_len % 2n
    == 0, a `tfjax.models.build` model), else 0. `note` says why "data" fell back to
    natural order: layers whose result depends on token order other than through
    attention's position-aware mask and position biases would see the tokens out of
    order (their layer kind or ffn kind record says so: `order_dependent`,
    `order_dependence`; ALiBi and T5's bias read the reordered positions in the ring
    itself), and a custom `build_model` (e.g. a test double) may derive its mask or
    positions from the array index."""
    m, t = cfg.model, cfg.train
    axes = [a for a in (dict(logical_rules(cfg.mesh.rules)).get("length") or ())
            if mesh.shape[a] > 1]
    if (m.attention.zigzag != "data" or m.attention.context_parallel not in ("ring", "usp")
            or len(axes) != 1):
        return 0, None
    n = mesh.shape[axes[0]]
    why = [] if OBJECTIVES.get(t.objective, field="train.objective").zigzag else [
        f"train.objective={t.objective!r} keeps its own token order"]
    why += [f"layer_pattern has {k!r} layers" for k in dict.fromkeys(m.layer_pattern)
           if LAYER_KINDS.get(k, field="model.layer_pattern").order_dependent]
    if build_model is not None and build_model is not build:
        why.append("a custom build_model, which may not read positions from the batch")
    why += [reason for k in dict.fromkeys(m.ffn_pattern)
            if (reason := FFN_KINDS.get(k, field="model.ffn_pattern").order_dependence(m))]
    if t.seq_len % (2 * n):
        why.append(f"train.seq_len={t.seq_len} is not divisible by 2 x {n} sequence devices")
    if why:
        return 0, (f"model.attention.zigzag='data' not applied ({'; '.join(why)}): batches stay in "
                   f"natural order; attention runs as with model.attention.zigzag='layer'")
    return n, None


def zigzag_rows(x: np.ndarray, n: int) -> np.ndarray:
    """`tfjax.parallel.zigzag.zigzag(x, n, axis=1)` in numpy, for a host batch `[B, T]`."""
    B, T = x.shape
    return x.reshape(B, 2 * n, T // (2 * n))[:, zigzag_order(n)].reshape(B, T)


@dataclasses.dataclass
class Program:
    """The compiled-to-be pieces of a run on a mesh: jitted init / train step / eval step
    with their shardings (what `--compile_only` lowers for a TPU topology)."""

    graphdef: Any
    eval_graphdef: Any
    tx: Any
    abstract_state: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    notes: list
    num_params: int
    init: Callable
    step: Callable
    eval: Callable
    zigzag: int = 0  # > 0: batches must be in zig-zag order over this many devices
    batch_shapes: dict | None = None  # the objective's batch: key -> global shape
    batch_shardings: dict | None = None  # key -> NamedSharding (rows over the batch axes)
    lora: Lora | None = None  # LoRA: `params` are the adapters, `frozen` the base
    start: Callable | None = None  # (model params, rest) -> the step-0 state (not jitted)
    reference: Reference | None = None  # the frozen model of dpo / ipo / grpo / distill


def build_program(cfg: RunConfig, mesh, build_model, teacher=None) -> Program:
    """Abstract model -> shardings (unknown logical axes fail here, before compiling) ->
    the jitted, sharded, donating train step. `teacher`: distillation's teacher model
    config (`tfjax.train.reference`)."""
    rules = logical_rules(cfg.mesh.rules)
    t = cfg.train

    def make_model():
        with nnx.use_eager_sharding(False):
            return build_model(cfg.model, rngs=nnx.Rngs(cfg.seed))

    check_backend(cfg.model.quant, mesh.devices.flat[0])
    abstract = nnx.eval_shape(make_model)
    graphdef, aparams, arest = nnx.split(abstract, nnx.Param, ...)
    abstract.eval()
    eval_graphdef = nnx.split(abstract, nnx.Param, ...)[0]
    # with LoRA (`tfjax.train.lora`) the optimizer sees the adapters alone
    abstract_state, lora, tx = train_state_shape(cfg, aparams, arest)
    ref = reference_of(cfg, eval_graphdef, aparams, arest, lora, build_model, teacher)
    if ref is not None and ref.abstract is not None:
        abstract_state = dict(abstract_state, reference=ref.abstract)
    notes: list[str] = [lora.summary(aparams)] if lora else []
    state_shardings = tree_shardings(abstract_state, mesh, rules, notes)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(aparams))

    def start(params, rest):
        extra = {}
        if ref is not None and (frozen := ref.start(params, rest)) is not None:
            extra["reference"] = frozen
        if lora is None:
            return dict(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params),
                        rest=rest, **extra)
        adapters = lora.init(params, jax.random.key(cfg.seed))
        return dict(step=jnp.zeros((), jnp.int32), params=adapters, opt=tx.init(adapters),
                    rest=rest, frozen=params, **extra)

    def init():
        with use_rules(mesh, rules):
            model = make_model()
            _, params, rest = nnx.split(model, nnx.Param, ...)
            return start(params, rest)

    # Batches: [B, T] split over the "batch" mesh axes; the step itself constrains
    # activations to ("batch", "length") (sequence sharding).
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", None), rules))
    objective = bound_objective(t.objective, t)
    shapes = objective.shapes(cfg)
    shardings = {k: NamedSharding(mesh, logical_to_spec(("batch", None)[:len(v)], rules))
                 for k, v in shapes.items()}
    rep = replicated(mesh)
    zz, note = zigzag_devices(cfg, mesh, build_model)
    if note:
        notes.append(note)
    local = local_gradient_axes(mesh, rules, state_shardings)
    if local and (ref is not None  # the frozen model's forward runs outside the local map
                  or changes_state(graphdef, aparams, arest, shapes, objective, t.loss_chunk)):
        local = ()
    if local:
        notes.append(f"gradients summed once a step over mesh axes {', '.join(local)} "
                     f"(local gradients: tfjax.train.step)")

    def traced(f):  # the layers read the data layout while jit traces the step
        if not zz:
            return f

        def g(*args):
            with zigzag_data(zz):
                return f(*args)
        return g

    return Program(
        graphdef=graphdef, eval_graphdef=eval_graphdef, tx=tx, abstract_state=abstract_state,
        state_shardings=state_shardings, batch_sharding=batch_sharding, notes=notes,
        num_params=num_params,
        init=jax.jit(init, out_shardings=state_shardings),
        zigzag=zz, batch_shapes=shapes, batch_shardings=shardings, lora=lora, start=start,
        reference=ref,
        step=jax.jit(traced(make_train_step(graphdef, tx, t, mesh, rules, lora and lora.merge,
                                            local, ref)),
                     in_shardings=(state_shardings, shardings),
                     out_shardings=(state_shardings, rep), donate_argnums=0),
        eval=jax.jit(traced(make_eval_step(eval_graphdef, mesh, rules, t.objective,
                                           lora and lora.merge, t.loss_chunk, ref, t)),
                     in_shardings=(state_shardings, shardings), out_shardings=rep))
