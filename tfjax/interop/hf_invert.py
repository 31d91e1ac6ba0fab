"""The inverse of a family's weights mapping, derived from the mapping itself.

`Inverse` runs a family's weights mapping (element movement only) on a checkpoint of
`Symbolic` tensors, so every parameter comes back as an expression over checkpoint
tensors: export writes each checkpoint tensor through them, and `hf.load` on a mesh
evaluates them forwards one device block at a time (`symbolic_checkpoint`,
`Symbolic.block`). Every element of every tensor read must be covered exactly once
(else a ValueError names the tensor); anything but element movement on a checkpoint
tensor is a TypeError naming the operation. See docs/interop.md.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import numpy as np

from tfjax.config import ModelConfig
from tfjax.interop.tensor_mapping import Weights

__all__ = ["Inverse", "Symbolic", "hf_shapes", "stack", "symbolic_checkpoint"]

_MOVES = "transpose, reshape, indexing, swapaxes, moveaxis, squeeze, expand_dims, stack, " \
         "concatenate, split"


def _probe(shape: tuple[int, ...]) -> np.ndarray:
    """A zero-strided array of `shape`: numpy's own shape rules (and errors) for free."""
    return np.broadcast_to(np.zeros((), np.int8), shape)


def _axes(args: tuple) -> Any:
    """`x.transpose(1, 0)`, `x.transpose((1, 0))` and `x.transpose()` alike (reshape too)."""
    if not args:
        return None
    one = len(args) == 1 and (args[0] is None or isinstance(args[0], (tuple, list)))
    return args[0] if one else args


class Symbolic:
    """A checkpoint tensor, or an element movement of checkpoint tensors, as a weights
    mapping sees it: `shape`, and an expression it records. `indices()` evaluates it on
    global element indices (each tensor's elements numbered from its `base`)."""

    def __init__(self, shape, fn: Callable | None = None, parents: tuple = (), *,
                 name: str = "", base: int = 0, split: tuple | None = None):
        self.shape = tuple(int(n) for n in shape)
        self.fn, self.parents, self.name, self.base = fn, tuple(parents), name, base
        self.split = split  # ("stack", axis) or ("concat", axis): members addressable apart
        self.sources: frozenset[str] = (frozenset([name]) if not parents else
                                        frozenset().union(*(p.sources for p in parents)))

    @classmethod
    def leaf(cls, name: str, shape, base: int) -> "Symbolic":
        return cls(shape, name=name, base=base)

    # numpy-array protocol ---------------------------------------------------
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    T = property(lambda self: self._move(lambda a: a.T))

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self) -> Iterator["Symbolic"]:
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self) -> str:
        return f"Symbolic({self.shape}, of {', '.join(sorted(self.sources))})"

    def _move(self, fn: Callable) -> "Symbolic":
        return Symbolic(fn(_probe(self.shape)).shape, fn, (self,))

    def transpose(self, *axes) -> "Symbolic":
        axes = _axes(axes)
        return self._move(lambda a: a.transpose(axes))

    def reshape(self, *shape) -> "Symbolic":
        shape = _axes(shape)
        return self._move(lambda a: a.reshape(shape))

    def __getitem__(self, key) -> "Symbolic":
        if any(isinstance(k, Symbolic) for k in (key if isinstance(key, tuple) else (key,))):
            raise TypeError("indexing by a checkpoint tensor is not element movement")
        return self._move(lambda a: a[key])

    def swapaxes(self, a1: int, a2: int) -> "Symbolic":
        return self._move(lambda a: a.swapaxes(a1, a2))

    def squeeze(self, axis=None) -> "Symbolic":
        return self._move(lambda a: a.squeeze(axis))

    def ravel(self) -> "Symbolic":
        return self.reshape(-1)

    flatten = ravel

    def astype(self, dtype, *args, **kwargs) -> "Symbolic":
        return self  # a cast moves nothing (export writes the dtype asked for)

    def copy(self) -> "Symbolic":
        return self

    def __array__(self, *args, **kwargs):
        raise TypeError("np.asarray of a checkpoint tensor: the export inverse "
                        f"(tfjax.interop.hf_invert) needs a mapping of element movement only "
                        f"({_MOVES})")

    def __array_ufunc__(self, ufunc, method, *args, **kwargs):
        raise TypeError(f"np.{ufunc.__name__} on a checkpoint tensor: not element movement, "
                        f"which is all the export inverse (tfjax.interop.hf_invert) handles "
                        f"({_MOVES})")

    def _arithmetic(self, *args):
        raise TypeError("arithmetic on a checkpoint tensor: not element movement, which is all "
                        f"the export inverse (tfjax.interop.hf_invert) handles ({_MOVES})")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _arithmetic
    __rtruediv__ = __pow__ = __neg__ = __matmul__ = __rmatmul__ = _arithmetic

    def __array_function__(self, func, types, args, kwargs):
        name = getattr(func, "__name__", str(func))
        if name not in _FUNCTIONS:
            raise TypeError(f"np.{name} on a checkpoint tensor: not element movement, which is "
                            f"all the export inverse (tfjax.interop.hf_invert) handles ({_MOVES})")
        return _FUNCTIONS[name](*args, **kwargs)

    # evaluation -------------------------------------------------------------
    def indices(self, local: bool = False) -> np.ndarray:
        """The global index of each element: an int64 array of `shape` (`local`: of an
        expression over one tensor, the index within it)."""
        if not self.parents:
            start = 0 if local else self.base
            return np.arange(start, start + self.size, dtype=np.int64).reshape(self.shape)
        return np.asarray(self.fn(*(p.indices(local) for p in self.parents)))

    def evaluate(self, leaf: Callable[[str], np.ndarray]) -> np.ndarray:
        """The expression's value over the arrays `leaf(name)` gives (memory-mapped
        checkpoint tensors): numpy's own element movements, so a view where numpy
        can make one (a stack or concatenation copies its members)."""
        if not self.parents:
            return leaf(self.name)
        return np.asarray(self.fn(*(p.evaluate(leaf) for p in self.parents)))

    def value_dtype(self, leaf: Callable[[str], np.ndarray]) -> np.dtype:
        """The value's dtype (the tensors' own, promoted where a stack mixes them)."""
        if not self.parents:
            return np.dtype(leaf(self.name).dtype)
        return np.result_type(*(p.value_dtype(leaf) for p in self.parents))

    def block(self, key: tuple[slice, ...], leaf: Callable[[str], np.ndarray],
              dtype=None) -> np.ndarray:
        """`evaluate(leaf)[key].astype(dtype)` as a fresh array (key: one `slice(start,
        stop)` per axis, as `slice.indices` gives), evaluating only the members of a
        stack / concatenation at the top of the expression that the block touches, each
        written straight into the block: a device's share of a stack of layers or
        experts reads that share and holds nothing else but, where numpy cannot view a
        member's movement, one member's copy."""
        if len(key) != self.ndim or any(not isinstance(k, slice) or k.start is None
                                        or k.stop is None or k.step not in (None, 1)
                                        for k in key):
            raise ValueError(f"block: want {self.ndim} slices of step 1 with start and stop "
                             f"(slice.indices of each axis), got {key}")
        out = np.empty(tuple(max(0, k.stop - k.start) for k in key),
                       self.value_dtype(leaf) if dtype is None else dtype)
        self._fill(key, leaf, out)
        return out

    def _fill(self, key: tuple[slice, ...], leaf: Callable, out: np.ndarray) -> None:
        if self.split is None:
            out[...] = self.evaluate(leaf)[key]  # numpy's cast, as astype's
            return
        kind, axis = self.split
        lo, hi = key[axis].start, key[axis].stop
        lead, start = (slice(None),) * axis, 0
        for p in self.parents:
            n = 1 if kind == "stack" else p.shape[axis]
            a, b = max(lo, start), min(hi, start + n)
            if a < b and kind == "stack":
                p._fill(key[:axis] + key[axis + 1:], leaf, out[lead + (a - lo,)])
            elif a < b:
                p._fill(key[:axis] + (slice(a - start, b - start),) + key[axis + 1:], leaf,
                        out[lead + (slice(a - lo, b - lo),)])
            start += n

    def pieces(self, selector: tuple = ()) -> Iterator[tuple[tuple, "Symbolic"]]:
        """`(selector, member)`: a stack / concatenation at the top of the expression split
        into its members, each with the index tuples that select its part of the value."""
        if self.split is None:
            yield selector, self
            return
        kind, axis = self.split
        lead = (slice(None),) * axis
        start = 0
        for i, p in enumerate(self.parents):
            if kind == "stack":
                part = lead + (i,)
            else:
                part = lead + (slice(start, start + p.shape[axis]),)
                start += p.shape[axis]
            yield from p.pieces(selector + (part,))


def symbolic_checkpoint(shapes: dict[str, tuple[int, ...]]) -> dict[str, Symbolic]:
    """`{name: Symbolic leaf}` of a checkpoint whose tensors have these shapes (each
    tensor's elements numbered after the previous one's), for a weights mapping to run on."""
    leaves, base = {}, 0
    for name, shape in shapes.items():
        leaves[name] = Symbolic.leaf(name, shape, base)
        base += leaves[name].size
    return leaves


def stack(arrays, axis: int = 0) -> Symbolic:
    """`np.stack` of Symbolic arrays (its members addressable apart, as `block` reads)."""
    return _stack(arrays, axis)


def _symbols(arrays, what: str) -> list[Symbolic]:
    arrays = list(arrays)
    if not all(isinstance(a, Symbolic) for a in arrays):
        raise TypeError(f"np.{what} of checkpoint tensors with other arrays: the export inverse "
                        "(tfjax.interop.hf_invert) needs every element from the checkpoint")
    return arrays


def _stack(arrays, axis: int = 0) -> Symbolic:
    xs = _symbols(arrays, "stack")
    shape = xs[0].shape
    if any(x.shape != shape for x in xs):
        raise ValueError(f"np.stack: shapes differ: {[x.shape for x in xs]}")
    axis = axis % (len(shape) + 1)
    return Symbolic(shape[:axis] + (len(xs),) + shape[axis:],
                    lambda *a: np.stack(a, axis), xs, split=("stack", axis))


def _concatenate(arrays, axis: int = 0) -> Symbolic:
    xs = _symbols(arrays, "concatenate")
    axis = axis % xs[0].ndim
    rest = [x.shape[:axis] + x.shape[axis + 1:] for x in xs]
    if any(r != rest[0] for r in rest):
        raise ValueError(f"np.concatenate: shapes differ off axis {axis}: {[x.shape for x in xs]}")
    shape = xs[0].shape[:axis] + (sum(x.shape[axis] for x in xs),) + xs[0].shape[axis + 1:]
    return Symbolic(shape, lambda *a: np.concatenate(a, axis), xs, split=("concat", axis))


def _split(x: Symbolic, sections, axis: int = 0, *, even: bool = True) -> list[Symbolic]:
    n = x.shape[axis]
    if isinstance(sections, int):
        if even and n % sections:
            raise ValueError(f"np.split: {n} does not divide into {sections} equal parts")
        q, r = divmod(n, sections)
        bounds = np.cumsum([0] + [q + (i < r) for i in range(sections)]).tolist()
    else:
        bounds = [0, *sections, n]
    lead = (slice(None),) * (axis % x.ndim)
    return [x[lead + (slice(a, b),)] for a, b in zip(bounds[:-1], bounds[1:])]


_FUNCTIONS: dict[str, Callable] = {
    "transpose": lambda a, axes=None: a.transpose(axes),
    "reshape": lambda a, *args, **kw: a.reshape(kw.get("shape", kw.get("newshape", *args[:1]))),
    "swapaxes": lambda a, a1, a2: a.swapaxes(a1, a2),
    "moveaxis": lambda a, src, dst: a._move(lambda b: np.moveaxis(b, src, dst)),
    "squeeze": lambda a, axis=None: a.squeeze(axis),
    "expand_dims": lambda a, axis: a._move(lambda b: np.expand_dims(b, axis)),
    "ascontiguousarray": lambda a, dtype=None: a,
    "stack": _stack,
    "concatenate": _concatenate,
    "split": lambda a, sections, axis=0: _split(a, sections, axis),
    "array_split": lambda a, sections, axis=0: _split(a, sections, axis, even=False),
}


def hf_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """`{tensor name: shape}` of what `save_pretrained` writes for transformers' model of
    the config dict `hf` (its `architectures[0]` class, built on torch's meta device: no
    memory, no init; tied copies left out and tensors renamed / split as transformers
    saves them, e.g. Mixtral's fused experts back to one tensor each). Needs the `hf`
    extra (torch, transformers)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"tfjax.interop.hf.export needs the hf extra (torch, transformers): "
                          f"pip install 'tfjax[hf]' ({e})") from None
    try:  # transformers >= 5 saves some tensors under other names than its modules'
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # 4.x: no conversions (and the mappings ignore tied copies)
        revert_weight_conversion = remove_tied_weights_from_state_dict = None
    cls = getattr(transformers, hf["architectures"][0], None)
    if cls is None:
        raise ValueError(f"export: transformers {transformers.__version__} has no "
                         f"{hf['architectures'][0]}; upgrade transformers")
    try:
        config = transformers.AutoConfig.for_model(
            hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
        with torch.device("meta"):
            model = cls._from_config(config)
    except Exception as e:  # transformers' config validation has its own error types
        raise ValueError(f"export: transformers {transformers.__version__} refuses the "
                         f"{hf['model_type']} config export made: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    if revert_weight_conversion is not None:  # as save_pretrained: no tied copies, saved names
        state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    return {k: tuple(v.shape) for k, v in state.items()}


class _Reads(dict):
    """The symbolic checkpoint: remembers which tensors the mapping read (not ignored)."""

    def __init__(self, leaves: dict[str, Symbolic]):
        super().__init__(leaves)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Symbolic:
        self.read.add(name)
        return super().__getitem__(name)


class Inverse:
    """A family's weights mapping run backwards, for one model config.

    weights: the family's `weights(w, cfg, hf)`; shapes: `{tensor name: shape}` of the
    HF model's state dict; prefix_aliases: as `Weights` takes them (the family's
    prefix, which transformers may save without). After construction `params` is `{our key: Symbolic}` (what
    the mapping made of the checkpoint) and `written` the tensors export writes, in
    the order to write them (by the first parameter that fills each)."""

    def __init__(self, weights: Callable[[Weights, ModelConfig, dict], dict],
                 cfg: ModelConfig, hf: dict, shapes: dict[str, tuple[int, ...]],
                 family: str = "the family", prefix_aliases: tuple[str, ...] = ()):
        self.family = family
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        leaves = self._leaves = symbolic_checkpoint(self.shapes)
        ckpt = _Reads(leaves)
        w = Weights(ckpt, prefix_aliases)
        self.params: dict[tuple, Symbolic] = weights(w, cfg, hf)
        left = w.leftovers()
        if left:
            raise ValueError(f"export: the {family} mapping neither reads nor ignores these "
                             f"tensors of the transformers model: {', '.join(left[:8])}"
                             f"{' ...' if len(left) > 8 else ''}")
        self._pieces: dict[str, list[tuple[tuple, tuple, Symbolic]]] = {}
        for key, sym in self.params.items():
            if not isinstance(sym, Symbolic):
                raise TypeError(f"export: parameter {key} does not come from a checkpoint "
                                f"tensor by element movement ({_MOVES}) in the {family} mapping")
            for selector, member in sym.pieces():
                for source in sorted(member.sources):
                    self._pieces.setdefault(source, []).append((key, selector, member))
        unused = sorted(ckpt.read - set(self._pieces))
        if unused:
            raise ValueError(f"export: the {family} mapping reads {', '.join(unused[:4])} but "
                             "no parameter comes from it, so export cannot write it")
        self.written = list(self._pieces)  # dicts keep the parameters' order

    def _scatter(self, name: str, put: Callable[[tuple, tuple, np.ndarray, np.ndarray], None]):
        leaf = self._leaves[name]
        for key, selector, member in self._pieces[name]:
            if len(member.sources) == 1:
                put(key, selector, member.indices(local=True), None)
                continue
            idx = member.indices()
            mask = (idx >= leaf.base) & (idx < leaf.base + leaf.size)
            put(key, selector, idx[mask] - leaf.base, mask)

    def check(self) -> None:
        """Every element of every written tensor comes from exactly one parameter
        element, or a ValueError names the tensor."""
        for name in self.written:
            written = np.zeros(self._leaves[name].size, np.bool_)
            filled = extra = 0

            def put(key, selector, idx, mask):
                nonlocal filled, extra
                written[idx] = True
                now = int(np.count_nonzero(written))
                extra += filled + idx.size - now  # writes that landed on a written element
                filled = now

            self._scatter(name, put)
            if filled < written.size or extra:
                raise ValueError(f"export: {name}: the inverse of the {self.family} mapping "
                                 f"leaves {written.size - filled} of its {written.size} elements "
                                 f"unwritten and writes {extra} more than once")

    def tensor(self, name: str, value: Callable[[tuple], np.ndarray], dtype) -> np.ndarray:
        """Checkpoint tensor `name` in `dtype`, from our parameters (`value(key)`: the
        array of our key, per layer)."""
        out = np.empty(self._leaves[name].size, dtype)

        def put(key, selector, idx, mask):
            v = np.asarray(value(key))
            for s in selector:
                v = v[s]
            v = np.asarray(v).astype(dtype, copy=False)
            out[idx] = v if mask is None else v[mask]

        self._scatter(name, put)
        return out.reshape(self.shapes[name])
