"""The collectives of a compiled program, read from its HLO text (`compiled.as_text()`):
kind, bytes per device, executions per step, and whether they cross slices (DCN).

A collective crosses slices when one of its replica groups (or source-target pairs)
holds devices of different slices (`slice_of[i]`: the slice of the program's i-th
device, `mesh.devices.flat` order); XLA:TPU compiles such a collective for several
slices into its part within each slice plus host transfers to the Megascale runtime
(`send` with `_xla_megascale_transfer_type`), which always cross. Bytes are each
device's input to one execution (for an all-gather, its shard); a collective inside a
while loop whose condition is `i < N` runs N times a step (other loops: once). See
docs/training.md ("Multi-slice").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

__all__ = ["KINDS", "Collective", "collectives", "dcn_totals"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_MEGASCALE = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
              "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
              "COLLECTIVE_PERMUTE": "collective-permute", "PERMUTE": "collective-permute"}
_DTYPE_BYTES = {"pred": 1, "token": 0, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([^\s(]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program: its kind (one of `KINDS`), each device's input
    bytes, executions per step, and whether it crosses slices."""

    kind: str
    bytes: int
    count: int
    dcn: bool


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            bits = re.search(r"\d+", dtype)
            size = int(bits.group()) / 8 if bits else 0
        total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * size)
    return total


def _operands(rest: str) -> list[str]:
    """The `%name`s of an instruction's operand list (the text after its opening
    parenthesis), up to the matching closing one."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([^\s,)]+)", rest[:i])
    return []


def _groups(attrs: str) -> list[list[int]] | None:
    """The device groups of a collective's attributes: explicit `{{0,1},{2,3}}`,
    iota `[2,4]<=[4,2]T(1,0)`, or source-target pairs; None when it names none (one
    group of every device)."""
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}",
                                                                         m.group(1))] or None
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if not m:
        return None
    shape, dims = ([int(x) for x in g.split(",")] for g in m.group(1, 2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape).tolist()


def _trip_counts(text: str, calls: dict[str, list[tuple[str, int]]]) -> dict[str, int]:
    """Executions per step of each computation, from ENTRY down the call graph."""
    entry = re.search(r"^ENTRY %([^\s(]+)", text, re.M)
    counts: dict[str, int] = {}
    stack = [(entry.group(1), 1)] if entry else []
    while stack:
        name, n = stack.pop()
        counts[name] = counts.get(name, 0) + n
        stack.extend((child, n * trips) for child, trips in calls.get(name, ()))
    return counts


def collectives(hlo: str, slice_of: Sequence[int] | None = None) -> list[Collective]:
    """Every collective in `hlo` (compiled HLO text), with `slice_of` deciding which
    cross slices (None: only the Megascale transfers count as crossing)."""
    shapes: dict[str, str] = {}
    found: list[tuple[str, str, list[str], str]] = []  # computation, kind, operands, attrs
    calls: dict[str, list[tuple[str, int]]] = {}
    loop_bound: dict[str, int] = {}  # condition computation -> N of its `i < N`
    whiles: list[tuple[str, str, str]] = []  # (computation, condition, body)
    current = ""
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op == "while":
            cond = re.search(r"condition=%([^\s,]+)", rest)
            body = re.search(r"body=%([^\s,]+)", rest)
            if cond and body:
                whiles.append((current, cond.group(1), body.group(1)))
        else:
            callees = re.findall(r"(?:calls|to_apply|true_computation|false_computation)="
                                 r"%([^\s,]+)", rest)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", rest):
                callees += re.findall(r"%([^\s,]+)", branches)
            calls.setdefault(current, []).extend((c, 1) for c in callees)
        if op == "constant" and re.fullmatch(r"s32\[\]\S*", shape):
            bound = re.match(r"(-?\d+)\)", rest)
            if bound:
                loop_bound.setdefault(current, int(bound.group(1)))
        if op == "compare" and "direction=LT" in rest:
            loop_bound.setdefault(current + "#lt", 1)
        megascale = re.search(r'_xla_megascale_transfer_type="([A-Z_]+)"', rest)
        if op == "send" and megascale:
            found.append((current, _MEGASCALE.get(megascale.group(1), megascale.group(1).lower()),
                          _operands(rest)[:1], "megascale"))
        kind = op[:-len("-start")] if op.endswith("-start") else op
        if kind in KINDS:
            found.append((current, kind, _operands(rest), rest))
    for parent, cond, body in whiles:
        trips = loop_bound.get(cond, 1) if (cond + "#lt") in loop_bound else 1
        calls.setdefault(parent, []).extend([(cond, trips), (body, trips)])
    counts = _trip_counts(hlo, calls)
    out = []
    for comp, kind, operands, attrs in found:
        per_device = sum(_bytes(shapes.get(o, "")) for o in operands)
        if attrs == "megascale":
            dcn = True
        else:
            groups = _groups(attrs)
            dcn = slice_of is not None and (
                len(set(slice_of)) > 1 if groups is None else
                any(len({slice_of[i] for i in g}) > 1 for g in groups))
        out.append(Collective(kind, per_device, counts.get(comp, 1), dcn))
    return out


def dcn_totals(found: Sequence[Collective]) -> dict[str, tuple[int, int]]:
    """{kind: (executions per step, bytes per device per step)} of the collectives
    that cross slices, by kind in `KINDS` order."""
    totals: dict[str, tuple[int, int]] = {}
    for c in found:
        if c.dcn:
            n, b = totals.get(c.kind, (0, 0))
            totals[c.kind] = (n + c.count, b + c.count * c.bytes)
    order = lambda k: KINDS.index(k) if k in KINDS else len(KINDS)  # noqa: E731
    return {k: totals[k] for k in sorted(totals, key=order)}
