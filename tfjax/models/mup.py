"""μP, the Maximal Update Parametrization (Yang et al. 2022, "Tensor Programs V"), for
Adam-type optimizers: `model.mup_base_width = b` makes a model of width `d_model` the
μP scaling of the standard model of width b, so a learning rate tuned at b transfers.

With m = d_model / b (`width_multiplier`), `classify` puts each parameter in a class
(input, hidden, output, readout; from its logical axes) whose init and learning rate
scale by `init_multiplier` / `lr_multiplier`; `rescale_init` applies the former after
building, the optimizer the latter. `check` refuses, by name, what μP is not defined
for here. See docs/models.md.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from tfjax.config import ModelConfig
from tfjax.parallel.rules import variable_axes

__all__ = ["CLASSES", "SUPPORTED_KINDS", "check", "classify", "init_multiplier",
           "lr_multiplier", "rescale_init", "width_multiplier"]

CLASSES = ("input", "hidden", "output", "readout")
SUPPORTED_KINDS = ("global", "local", "chunked", "nope")
STACK_AXES = ("layers", "expert")  # stacked copies of one parameter
TABLE_AXES = ("vocab", "max_len", "relpos_buckets", "type_vocab")


def check(cfg: ModelConfig) -> None:
    """Raise a ValueError naming the field when μP is on for a model it does not
    cover (μP off: nothing to check)."""
    if not cfg.mup_base_width:
        return
    field = "model.mup_base_width"
    if cfg.arch != "decoder":
        raise ValueError(f"{field}: μP is defined here for arch='decoder' (the LM head's "
                         f"logits), not arch={cfg.arch!r}; set {field}=0")
    kinds = sorted({cfg.layer_kind(i) for i in range(cfg.num_layers)} - set(SUPPORTED_KINDS))
    if kinds:
        raise ValueError(f"{field}: μP's parameter classes are defined here for the attention "
                         f"layer kinds {', '.join(SUPPORTED_KINDS)}, not {', '.join(kinds)}; "
                         f"set {field}=0")


def width_multiplier(cfg: ModelConfig) -> float:
    """m = d_model / model.mup_base_width (1 when μP is off)."""
    return cfg.d_model / cfg.mup_base_width if cfg.mup_base_width else 1.0


def classify(x) -> str:
    """μP's class of parameter `x` (a Variable with logical axes): input, hidden,
    output or readout (the table in docs/models.md)."""
    names = variable_axes(x) or ()
    core = [n for n in names if n not in STACK_AXES]
    if "embed" not in core or len(core) < 2:
        return "input"  # biases, norm scales, sinks, relative-position tables
    if core[0] in TABLE_AXES:
        return "input"  # embedding tables
    if "vocab" in core:
        return "readout"  # the untied output head [embed, vocab]
    others = [n for n in core if n != "embed"]
    if all(n is None for n in others):
        return "output"  # [embed, a fixed size]: routers
    return "hidden"


def init_multiplier(kind: str, m: float) -> float:
    return {"input": 1.0, "hidden": 1.0 / math.sqrt(m), "output": 1.0 / m, "readout": 1.0}[kind]


def lr_multiplier(kind: str, m: float) -> float:
    return {"input": 1.0, "hidden": 1.0 / m, "output": 1.0 / m, "readout": 1.0}[kind]


def rescale_init(model: nnx.Module, cfg: ModelConfig) -> nnx.Module:
    """Multiply each parameter of a freshly built `model` by its class's init
    multiplier (in place; returns `model`). A no-op when μP is off."""
    m = width_multiplier(cfg)
    if m == 1.0:
        return model
    params = nnx.state(model, nnx.Param)

    def one(v):
        c = init_multiplier(classify(v), m)
        return v if c == 1.0 else v.replace(v.get_value() * c)

    nnx.update(model, jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return model
