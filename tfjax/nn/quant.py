"""Quantization by rules on module paths (MaxText's qwix rules): int8 / fp8 training
(`model.quant`) through qwix's QT ops, and weight-only int8 / int4 for decoding.

`quantize(model, fmt, paths=, exclude=)` gives every `nnx.Linear`, `nnx.Einsum` and MoE
expert matmul whose path (`layers/cycles/layers/0/ffn/wi`) fully matches `paths` and not
`exclude` qwix's `dot_general_qt` (`ragged_dot_qt` for dropless experts): both operands
quantized with dynamic absmax scales per channel, gradients too; parameters stay float.
`quantize_weights(model, "int8" | "int4", group=)` stores those layers' weights as qwix
`QArray`s that their matmuls take (`weight_only_dot_general`: s8 / s4 into the dot,
scales on the product); `quantize_for_serving` adds the 8-bit K/V cache. `check_backend`
refuses a format a device lacks. See docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import dot_general as qwix_dot_general
from qwix._src.core import dot_general_qt, qarray, ragged_dot_qt
from qwix._src.core import einsum as qwix_einsum

from tfjax.nn.moe import MoE
from tfjax.ops import kv_quant
from tfjax.nn.state import RecurrentMixer

__all__ = ["FORMATS", "GROUPS", "QUANT_PATHS", "QuantizedKernel", "QuantizedOp", "QuantizedOps",
           "QuantizedParam", "WEIGHT_FORMATS", "check_backend", "quantize", "quantize_for_serving",
           "quantize_weights", "quantized_paths", "weight_bytes", "weight_only_dot_general",
           "weight_only_einsum"]

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


def _selected_modules(model: nnx.Module, paths: str, exclude: str):
    """`(name, module)` of each submodule whose path ("layers/cycles/0/attn/q") the rule
    selects: `paths` matches it whole and `exclude` (if any) does not."""
    keep, drop = _compile("model.quant_paths", paths), _compile("model.quant_exclude", exclude)
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if keep.fullmatch(name) and not (exclude and drop.fullmatch(name)):
            yield name, module


def quantized_paths(model: nnx.Module, *, paths: str = QUANT_PATHS,
                    exclude: str = "") -> list[str]:
    """The module paths whose matmuls `quantize` replaces (Linear, Einsum, MoE experts);
    raises on a recurrent mixer the rule reaches."""
    out = []
    for name, module in _selected_modules(model, paths, exclude):
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


# Weight-only quantization for serving ------------------------------------------------

WEIGHT_FORMATS = ("int8", "int4")
GROUPS = (32, 64, 128)
_EXPERT_WEIGHTS = ("wi", "wi_gate", "wi_up", "wo")  # a MoE's expert matmuls (not its router)


class QuantizedParam(nnx.Param):
    """A weight stored quantized: its value a qwix `QArray` (int8 / int4 values and
    float scales); reading it (`param[...]`, as MoE reads its experts) gives the
    dequantized array."""

    def __getitem__(self, key):
        return self.dequantized()[key]

    def dequantized(self) -> jax.Array:
        return qarray.dequantize(self.get_value())


class QuantizedKernel(QuantizedParam):
    """The kernel of a Linear / Einsum whose matmul takes the `QArray` itself
    (`weight_only_dot_general`): reading it gives the `QArray`; `dequantized()` the
    float array (MLA's absorbed decode reads its `kv_b` so)."""

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise IndexError(f"QuantizedKernel: read it whole ([...]), not [{key!r}]")
        return self.get_value()


def _promote(arrays, /, *, dtype=None, inexact=True):
    """flax's `promote_dtype` for a layer whose kernel is a `QArray`: the float arrays
    go to `dtype` (default: their result type with the scales'); the QArray stays."""
    del inexact
    floats = [a for a in arrays if a is not None and not isinstance(a, qarray.QArray)]
    scales = [a.scale.dtype for a in arrays if isinstance(a, qarray.QArray)]
    dtype = dtype or jnp.result_type(*floats, *scales)
    return tuple(a if a is None or isinstance(a, qarray.QArray) else jnp.asarray(a, dtype)
                 for a in arrays)


def weight_only_dot_general(lhs, rhs, dimension_numbers, precision=None,
                            preferred_element_type=None, out_sharding=None):
    """`lax.dot_general` where one operand is a `QArray` of weights: the dot takes its
    int8 / int4 values (converted to the other operand's dtype, a convert XLA:TPU fuses
    into the dot, whose operand stays s8 / s4) and the scales multiply the product:
    per channel once, per group each group's partial product before the groups are
    summed (qwix's dequantize-on-output). No dequantized copy of the weight exists."""
    del out_sharding
    ops = (lhs, rhs)
    dtype = next((a.dtype for a in ops if not isinstance(a, qarray.QArray)), None)
    if dtype is None:
        raise ValueError("weight_only_dot_general: one operand must be a float array")
    for a, contracted in zip(ops, dimension_numbers[0]):
        if isinstance(a, qarray.QArray) and any(
                a.scale.shape[i] == a.shape[i] > 1 for i in contracted):
            # a scale per index of a contracted axis (a group of 32 over an output
            # projection's H = 32 gives each head its own): dequantize first, as qwix does
            lhs, rhs = (qarray.dequantize(x).astype(dtype) if isinstance(x, qarray.QArray)
                        else x for x in ops)
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                       preferred_element_type=preferred_element_type)
    lhs, rhs = (a.replace(qvalue=a.qvalue.astype(dtype)) if isinstance(a, qarray.QArray)
                else a for a in ops)
    out = qwix_dot_general._fast_dot_general(  # noqa: SLF001 (qwix's own fast path)
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=jnp.float32)
    return out.astype(preferred_element_type or dtype)


def weight_only_einsum(spec, *operands, precision=None, preferred_element_type=None,
                       out_sharding=None, **kwargs):
    """`jnp.einsum`'s signature over a `QArray` kernel (`nnx.Einsum(einsum_op=)`),
    contracted by `weight_only_dot_general`."""
    del out_sharding, kwargs
    dtype = next(a.dtype for a in operands if not isinstance(a, qarray.QArray))
    out = qwix_einsum.einsum(spec, *operands, precision=precision,
                             _qwix_dot_general=weight_only_dot_general)
    return out.astype(preferred_element_type or dtype)


def _contracted_axes(module, name: str, ndim: int) -> tuple[int, ...]:
    """The axes of `module`'s weight `name` (of `ndim` axes, a scanned stack's leading
    layer axes included) that its matmul contracts."""
    if isinstance(module, nnx.Einsum):
        spec = module.einsum_str.replace(" ", "")
        ins, out = spec.split("->")
        kernel = ins.split(",")[1]
        lead = ndim - len(kernel)
        return tuple(lead + i for i, c in enumerate(kernel) if c not in out)
    return (ndim - 2,)  # Linear [..., in, out]; MoE experts [..., E, in, out]


def _weights(module) -> list[str]:
    if isinstance(module, (nnx.Linear, nnx.Einsum)):
        return ["kernel"]
    return [n for n in _EXPERT_WEIGHTS if isinstance(getattr(module, n, None), nnx.Param)]


def _how(fmt: str, shape, contracted, group: int | None, where: str) -> qarray.HowToQuantize:
    """Per channel: one scale per output channel (and stacked layer). Per group: one
    scale per `group` consecutive inputs of the contraction, taken from its innermost
    axes (an output projection's `[N, H]`: a group of 128 over H = 64 spans two heads)."""
    free = tuple(a for a in range(len(shape)) if a not in contracted)
    if group is None:
        return qarray.HowToQuantize(qtype=jnp.dtype(fmt), channelwise_axes=free)
    tiles, left = {}, group
    for axis in reversed(contracted):
        if left == 1:
            tiles[axis] = 1  # outside the group: a scale per index
        elif left % shape[axis] == 0:
            tiles[axis], left = shape[axis], left // shape[axis]
        elif shape[axis] % left == 0:
            tiles[axis], left = left, 1
        else:
            break
    if left != 1:
        width = int(np.prod([shape[a] for a in contracted]))
        fits = [str(g) for g in GROUPS if width % g == 0]
        raise ValueError(f"quantize_group={group}: {where} contracts {width} inputs "
                         f"({' x '.join(str(shape[a]) for a in contracted)}), which groups of "
                         f"{group} do not tile; use quantize_group "
                         f"{' / '.join(fits) if fits else '(none fits)'} or per channel "
                         f"(no quantize_group)")
    return qarray.HowToQuantize(qtype=jnp.dtype(fmt), tiled_axes=tiles, channelwise_axes=free)


def quantize_weights(model: nnx.Module, fmt: str, *, group: int | None = None,
                     paths: str = QUANT_PATHS, exclude: str = "") -> nnx.Module:
    """`model` (changed in place) with the matmul weights of the Linear, Einsum and MoE
    expert layers that `paths` / `exclude` select stored as `fmt` ("int8" / "int4")
    with symmetric absmax scales (qwix's `QArray`): per output channel, or per `group`
    of 32 / 64 / 128 inputs along the contraction. Weight-only: activations, the
    embeddings, the head and MoE routers stay float ("none": unchanged)."""
    if fmt == "none":
        return model
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"--quantize: {fmt!r} is not a weight format; use one of 'none', "
                         f"{', '.join(map(repr, WEIGHT_FORMATS))}")
    if group is not None and group not in GROUPS:
        raise ValueError(f"--quantize_group: {group} is not a group size; use one of "
                         f"{', '.join(map(str, GROUPS))}, or none for per channel")
    chosen = []
    for name, module in _selected_modules(model, paths, exclude):
        if isinstance(module, nnx.Embed):
            raise ValueError(f"--quantize {fmt}: {name} is an embedding (a lookup, no matmul "
                             f"weight to dequantize at); weight-only quantization takes "
                             f"Linear, Einsum and MoE expert layers: add {name!r} to "
                             f"model.quant_exclude")
        if isinstance(module, (nnx.Linear, nnx.Einsum, MoE)):
            chosen.append((name, module))
    if not chosen:
        raise ValueError(f"model.quant_paths: {paths!r} (less model.quant_exclude "
                         f"{exclude!r}) matches no Linear, Einsum or MoE layer; the "
                         f"default {QUANT_PATHS!r} takes every layer of the stack")
    for name, module in chosen:
        for weight in _weights(module):
            param = getattr(module, weight)
            if isinstance(param, QuantizedParam):
                raise ValueError(f"quantize_weights: {name}/{weight} is quantized already")
            value = param.get_value()
            how = _how(fmt, value.shape, _contracted_axes(module, weight, value.ndim), group,
                       f"{name}/{weight} {tuple(value.shape)}")
            direct = isinstance(module, (nnx.Linear, nnx.Einsum))
            setattr(module, weight, (QuantizedKernel if direct else QuantizedParam)(
                qarray.quantize(value, how), **param.get_metadata()))
        if isinstance(module, nnx.Linear):
            module.dot_general, module.promote_dtype = weight_only_dot_general, _promote
        elif isinstance(module, nnx.Einsum):
            module.einsum_op, module.promote_dtype = weight_only_einsum, _promote
    return model


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of `model`'s parameters as stored: int4 values count half a byte (XLA
    packs them two to a byte on TPU and GPU)."""
    total = 0
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        bits = jnp.iinfo(leaf.dtype).bits if jnp.issubdtype(leaf.dtype, jnp.integer) else \
            jnp.finfo(leaf.dtype).bits
        total += leaf.size * bits // 8
    return total


def quantize_for_serving(model: nnx.Module, *, weights: str = "none", group: int | None = None,
                         kv: str = "none", device=None) -> nnx.Module:
    """A built (trained or loaded) model made ready to decode in fewer bytes: its weights
    `quantize_weights(weights, group)` under its config's `quant_paths` /
    `quant_exclude`, its caches `kv` ("int8" / "fp8": `model.kv_quant`, checked
    against `device`, default the first). Changed in place; returned."""
    cfg = model.config
    if kv != "none":
        kv_quant.check_backend(kv, device or jax.devices()[0])
        model.config = dataclasses.replace(cfg, kv_quant=kv)
    return quantize_weights(model, weights, group=group, paths=cfg.quant_paths,
                            exclude=cfg.quant_exclude)
