"""Quantized training (`model.quant = "int8" | "fp8"`) through qwix's QT ops, applied to a
built model by rules on module paths (MaxText's qwix rules).

`quantize(model, fmt, paths=, exclude=)` gives every `nnx.Linear`, `nnx.Einsum` and MoE
expert matmul whose module path (`layers/cycles/layers/0/ffn/wi`) fully matches `paths`
and not `exclude` qwix's `dot_general_qt` (`ragged_dot_qt` for dropless experts): both
operands quantized with dynamic absmax scales per channel (per token for activations,
per output channel for weights), the incoming gradients too (straight-through). The op
is a static attribute of the layer, so it runs inside the scanned stack and under any
mesh; parameters stay float (checkpoints unchanged). `check_backend` refuses a format a
device has no matmul for. See docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx
from qwix._src.core import dot_general_qt, ragged_dot_qt

from tfjax.nn.moe import MoE
from tfjax.nn.state import RecurrentMixer

__all__ = ["FORMATS", "QUANT_PATHS", "QuantizedOp", "QuantizedOps", "quantize", "check_backend",
           "quantized_paths"]

# format -> (forward operands' type, incoming gradients' type); fp8 as MaxText's
# "fp8_full": e4m3 forward (precision), e5m2 gradients (range)
FORMATS: dict[str, tuple[str, str]] = {
    "int8": ("int8", "int8"),
    "fp8": ("float8_e4m3fn", "float8_e5m2"),
}
# the default rule: every layer of a layer stack (MaxText: "decoder/.*layers.*"); the
# embeddings, the output head and the MTP modules stay float; MoE routers always do
QUANT_PATHS = r"(.*/)?layers/.*"


@dataclasses.dataclass(frozen=True)
class QuantizedOps:
    """The quantized matmuls of one format; hashable, it is a layer's static attribute."""

    fwd: str
    bwd: str

    def _config(self) -> dot_general_qt.DotGeneralQtConfig:
        return dot_general_qt.DotGeneralQtConfig(
            lhs_qtype=self.fwd, rhs_qtype=self.fwd,
            dlhs_grad_qtype=self.bwd, drhs_grad_qtype=self.bwd)

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, out_sharding=None):
        """`lax.dot_general`'s signature (`nnx.Linear(dot_general=)`); precision and
        out_sharding have no meaning for quantized operands."""
        del precision, out_sharding
        out = dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, self._config())
        return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))

    def einsum(self, spec, *operands, precision=None, preferred_element_type=None,
               out_sharding=None, **kwargs):
        """`jnp.einsum`'s signature (`nnx.Einsum(einsum_op=)`, MoE's expert einsums)."""
        del precision, out_sharding, kwargs
        out = jnp.einsum(spec, *operands, _dot_general=self.dot_general)
        return out.astype(preferred_element_type or jnp.result_type(*operands))

    def ragged_dot(self, lhs, rhs, group_sizes, **kwargs):
        """`lax.ragged_dot`'s (MoE's dropless experts)."""
        del kwargs
        config = ragged_dot_qt.RaggedDotQtConfig(
            lhs_qtype=self.fwd, rhs_qtype=self.fwd,
            dlhs_grad_qtype=self.bwd, drhs_grad_qtype=self.bwd)
        out = ragged_dot_qt.ragged_dot_qt(lhs, rhs, group_sizes, config)
        return out.astype(jnp.result_type(lhs, rhs))


@dataclasses.dataclass(frozen=True)
class QuantizedOp:
    """`ops`' method `name` as a value (equal and hashable by its fields, which a bound
    method is not: it compares its instance by identity)."""

    ops: QuantizedOps
    name: str

    def __call__(self, *args, **kwargs):
        return getattr(self.ops, self.name)(*args, **kwargs)


def _compile(field: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field}: {pattern!r} is not a regular expression ({e}); "
                         f"write a Python regex matched against module paths such as "
                         f"'layers/cycles/layers/0/ffn/wi'") from None


def quantized_paths(model: nnx.Module, *, paths: str = QUANT_PATHS,
                    exclude: str = "") -> list[str]:
    """The module paths whose matmuls `quantize` replaces (Linear, Einsum, MoE experts);
    raises on a recurrent mixer the rule reaches."""
    keep, drop = _compile("model.quant_paths", paths), _compile("model.quant_exclude", exclude)
    out = []
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if not keep.fullmatch(name) or (exclude and drop.fullmatch(name)):
            continue
        if isinstance(module, RecurrentMixer):
            raise ValueError(
                f"model.quant: {name} is a {type(module).__name__}, whose recurrence runs "
                f"its own scan einsums that qwix's quantized training does not cover; "
                f"quant takes attention (global, local, chunked, nope, mla), FFN and MoE "
                f"layers: add {name!r} to model.quant_exclude")
        if isinstance(module, (nnx.Linear, nnx.Einsum, MoE)):
            out.append(name)
    return out


def quantize(model: nnx.Module, fmt: str, *, paths: str = QUANT_PATHS,
             exclude: str = "") -> nnx.Module:
    """`model` (changed in place) with the matmuls of the layers `paths` / `exclude`
    select quantized to `fmt` ("none": unchanged)."""
    if fmt == "none":
        return model
    if fmt not in FORMATS:
        raise ValueError(f"model.quant: {fmt!r} is not a format; use one of "
                         f"'none', {', '.join(map(repr, FORMATS))}")
    selected = set(quantized_paths(model, paths=paths, exclude=exclude))
    if not selected:
        raise ValueError(f"model.quant_paths: {paths!r} (less model.quant_exclude "
                         f"{exclude!r}) matches no Linear, Einsum or MoE layer; the "
                         f"default {QUANT_PATHS!r} takes every layer of the stack")
    ops = QuantizedOps(*FORMATS[fmt])
    for path, module in nnx.iter_modules(model):
        if "/".join(map(str, path)) not in selected:
            continue
        if isinstance(module, nnx.Linear):
            module.dot_general = QuantizedOp(ops, "dot_general")
        elif isinstance(module, nnx.Einsum):
            module.einsum_op = QuantizedOp(ops, "einsum")
        else:  # MoE: its experts; the router stays float
            module.expert_einsum = QuantizedOp(ops, "einsum")
            module.expert_ragged_dot = QuantizedOp(ops, "ragged_dot")
    return model


# fp8 needs NVIDIA's fp8 tensor cores (compute capability 8.9: Ada, Hopper and later);
# XLA:TPU compiles f8 dots for v5e and v6e (experiments/results/quant.md) and XLA:CPU
# converts them up (tests and compile-only runs).
def _fp8_reason(device) -> str | None:
    if device.platform not in ("gpu", "cuda"):
        return None
    cc = getattr(device, "compute_capability", None)
    if cc is not None and tuple(map(int, str(cc).split("."))) < (8, 9):
        return f"{device.device_kind} (compute capability {cc}, fp8 needs >= 8.9)"
    return None


def check_backend(fmt: str, device) -> None:
    """Raise (one line) when `device` has no matmul for `fmt`."""
    if fmt == "fp8" and (reason := _fp8_reason(device)) is not None:
        raise ValueError(f"model.quant='fp8': {reason} has no fp8 matmul; use "
                         f"model.quant='int8' there (fp8 runs on NVIDIA GPUs of compute "
                         f"capability >= 8.9, TPUs and, converted up, CPUs)")
