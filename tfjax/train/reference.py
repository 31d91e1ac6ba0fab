"""The frozen second model an objective compares the policy with: DPO / IPO's reference
(the starting policy, run in the same step), GRPO's KL reference (train.grpo.beta > 0,
run at each rollout batch) and distillation's teacher.

`Reference` holds its graph (eval mode: no dropout) and where its weights live in the
train state: with LoRA the reference is the frozen base itself (`state["frozen"]`, the
adapters off: no copy); otherwise `state["reference"]` = {params, rest}, a copy of the
starting parameters or the teacher's, never optimised, checkpointed with the state so
a resume is exact. See docs/training.md ("Post-training").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import REFERENCE_OBJECTIVES, ModelConfig, RunConfig

__all__ = ["Reference", "reference_of"]


@dataclasses.dataclass(frozen=True)
class Reference:
    """kind: "reference" | "teacher"; graphdef: the frozen model's (eval mode);
    abstract: the abstract `state["reference"]` ({params, rest}), None when it is the
    LoRA base (`state["frozen"]` with the policy's `rest`)."""

    kind: str
    graphdef: Any
    abstract: Any | None
    make: Any = None  # teacher: () -> a freshly built teacher module (its shapes, its rest)

    def parts(self, state) -> tuple[Any, Any]:
        """(params, rest) of the frozen model in `state`."""
        if self.abstract is None:
            return state["frozen"], state["rest"]
        return state["reference"]["params"], state["reference"]["rest"]

    def model(self, params, rest) -> nnx.Module:
        """The frozen model on (params, rest), cut off from the gradient."""
        params = jax.tree.map(jax.lax.stop_gradient, params)
        return nnx.merge(self.graphdef, params, jax.tree.map(lambda x: x, rest))

    def start(self, params, rest) -> dict | None:
        """`state["reference"]` of a fresh run: a copy of the starting policy, the
        teacher as built (its weights are then read in by the trainer), or None (LoRA
        base)."""
        if self.abstract is None:
            return None
        if self.kind == "teacher":
            _, tparams, trest = nnx.split(self.make(), nnx.Param, ...)
            return dict(params=tparams, rest=trest)
        return dict(params=jax.tree.map(jnp.copy, params), rest=jax.tree.map(jnp.copy, rest))


def reference_of(cfg: RunConfig, eval_graphdef, aparams, arest, lora, build_model,
                 teacher: ModelConfig | None = None) -> Reference | None:
    """The frozen model `train.objective` needs, or None. `teacher`: the teacher's model
    config (`tfjax.train.init_from.teacher_config`), required by "distill"."""
    objective = cfg.train.objective
    if objective in REFERENCE_OBJECTIVES or (objective == "grpo" and cfg.train.grpo.beta > 0):
        if lora is not None:
            return Reference("reference", eval_graphdef, None)
        return Reference("reference", eval_graphdef, dict(params=aparams, rest=arest))
    if objective != "distill":
        return None
    if teacher is None:
        raise ValueError("train.teacher: train.objective='distill' needs the teacher's model "
                         "config; set --config.train.teacher=DIR")

    def make():
        with nnx.use_eager_sharding(False):
            return build_model(teacher, rngs=nnx.Rngs(cfg.seed))

    abstract = nnx.eval_shape(make)
    abstract.eval()
    graphdef, tparams, trest = nnx.split(abstract, nnx.Param, ...)
    return Reference("teacher", graphdef, dict(params=tparams, rest=trest), make)
