"""Context parallelism for a layer: which sequence-parallel attention a self-attention
layer runs under an active mesh whose rules split "length" over one axis of size n > 1.

`context_parallel_attention(q, k, v, mask, *, mode, zigzag, implementation, ...)`:
"ring" (`ring_attention`, zig-zag balanced as `zigzag` says), "all_gather"
(`all_gather_attention`), "ulysses" (`ulysses_attention`) or "usp" (`usp_attention`:
Ulysses in groups of `ulysses_size` devices, the ring across them), running `implementation`
per ring block (`select_ring_block`), per device at its global query offset, or per
device on its heads over the whole sequence (`CONTEXT_PARALLEL_MODES`). Otherwise None:
the layer uses `dot_product_attention`. See docs/long_context.md.
"""

from __future__ import annotations

from tfjax.ops import masks as masks_lib
from tfjax.ops.reference import Alibi, RelativeBias
from tfjax.parallel.ring_attention import all_gather_attention, ring_attention
from tfjax.parallel.sharding import active_mesh, logical_to_spec
from tfjax.parallel.ulysses import ulysses_attention, usp_attention
from tfjax.parallel.zigzag import ZIGZAG_MODES, zigzag_data_devices

__all__ = ["CONTEXT_PARALLEL_MODES", "context_parallel_attention"]

CONTEXT_PARALLEL_MODES = ("ring", "all_gather", "ulysses", "usp")


def context_parallel_attention(q, k, v, mask: masks_lib.Mask | None = None, *, mode: str = "ring",
                               zigzag: str = "data", implementation: str = "auto", scale=None,
                               softcap=None, alibi: Alibi | None = None,
                               relative_bias: RelativeBias | None = None, sinks=None,
                               ulysses_size: int = 1):
    """Attention for a layer under an active mesh whose rules split "length" over a
    mesh axis of size n > 1: `ring_attention` (mode "ring"), `all_gather_attention`
    (mode "all_gather"), `ulysses_attention` (mode "ulysses") or `usp_attention` (mode
    "usp", groups of `ulysses_size` devices), running `implementation` as the module
    docstring says. Returns None when no such mesh is active or the call is not
    sequence-parallel self-attention (T != S, e.g. cross-attention): the caller
    then uses `dot_product_attention`.

    Ring load balancing (`zigzag`, when T % 2n == 0 and there is a mask; USP's ring
    across its groups likewise): under `zigzag_data(n)` (the trainer's steps with
    `zigzag="data"`) q, k, v and the mask's segment ids are already in zig-zag order,
    so the ring (or USP) runs with `natural_order=False` and the output stays in that
    order; otherwise ("data"
    outside such a step, e.g. sampling, or "layer") the data is in natural order and
    the ring re-lays it out in and out (four half-chunk ppermutes per tensor);
    "none": contiguous chunks, no balancing. Masks are evaluated on global natural
    positions either way (the ring passes each chunk's global offset). `alibi`: a
    `tfjax.ops.Alibi`, `relative_bias` a `tfjax.ops.RelativeBias` (T5; their explicit
    positions are per-token arrays, laid out like the segment ids); `sinks` `[N]`
    learned sink logits (`tfjax.ops.sinks`).
    """
    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(f"context_parallel: got {mode!r}; allowed: "
                         f"{', '.join(map(repr, CONTEXT_PARALLEL_MODES))}")
    if zigzag not in ZIGZAG_MODES:
        raise ValueError(f"zigzag: got {zigzag!r}; allowed: {', '.join(map(repr, ZIGZAG_MODES))}")
    data_n = zigzag_data_devices()
    if data_n and (zigzag != "data" or mode not in ("ring", "usp")):
        raise ValueError(f"context_parallel: the batch is in zig-zag order (zigzag_data({data_n}))"
                         f" but this layer has context_parallel={mode!r}, zigzag={zigzag!r}; "
                         f"only context_parallel='ring' or 'usp' with zigzag='data' reads that "
                         f"order")
    mesh = active_mesh()
    seq_axes = ()
    if mesh is not None and q.shape[1] == k.shape[1]:
        batch_axes, seq_axes = tuple(logical_to_spec(("batch", "length")))
        batch_axes = () if batch_axes is None else batch_axes  # the rules' word, not inferred
        seq_axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes or ())
        seq_axes = tuple(a for a in seq_axes if mesh.shape[a] > 1)
    if not seq_axes:
        if data_n:
            raise ValueError(f"context_parallel: the batch is in zig-zag order over {data_n} "
                             f"devices but this attention (q {q.shape}, k {k.shape}) is not "
                             f"sequence-parallel self-attention, so it would read the tokens "
                             f"out of order; use model.attention.zigzag='layer'")
        return None
    if len(seq_axes) > 1:
        raise ValueError(f"context_parallel: the rules split 'length' over several mesh axes "
                         f"{seq_axes}; ring attention runs over one (map 'length' to one axis)")
    seq_axis, n, T = seq_axes[0], mesh.shape[seq_axes[0]], q.shape[1]
    if data_n and (data_n != n or T % (2 * n)):
        raise ValueError(f"context_parallel: the batch is in zig-zag order over {data_n} "
                         f"devices, but {seq_axis!r} has {n} and T={T} (zig-zag needs "
                         f"T % {2 * n} == 0)")
    common = dict(mesh=mesh, seq_axis=seq_axis, batch_axes=batch_axes, scale=scale,
                  softcap=softcap, implementation=implementation, relative_bias=relative_bias,
                  sinks=sinks, **Alibi.kwargs(alibi))
    if mode == "all_gather":
        return all_gather_attention(q, k, v, mask, **common)
    if mode == "ulysses":
        return ulysses_attention(q, k, v, mask, **common)
    zz = bool(data_n) or (zigzag != "none" and mask is not None and T % (2 * n) == 0)
    if mode == "usp":  # the ring over the n / ulysses_size groups, zig-zag over their spans
        return usp_attention(q, k, v, mask, ulysses_size=ulysses_size,
                             load_balance="zigzag" if zz else "none", natural_order=not data_n,
                             **common)
    return ring_attention(q, k, v, mask, load_balance="zigzag" if zz else "none",
                          natural_order=not data_n, **common)
