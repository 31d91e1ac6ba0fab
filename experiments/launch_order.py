"""Launch order of the GPU attention kernels: the tail a causal mask leaves, modelled.

    .venv/bin/python experiments/launch_order.py            # full: ~10 s
    .venv/bin/python experiments/launch_order.py --quick    # the CI's size

Model. A program (CTA) of the forward or dq grid computes one query tile and visits
the non-empty kv tiles of its row of the tile table (`tfjax.ops.tiles.tile_tables` of the
real mask, its block view), at a cost proportional to their number. The GPU starts
programs in grid order whenever a resident one finishes; `slots` = SMs x programs
resident per SM (an H100 / H200 has 132 SMs; ptxas's report gives 1 program per SM
for the Hopper forward and 2 for the Triton forward at H=128,
experiments/results/attention_gpu_ptxas_20261130.md). The makespan of this greedy
list schedule over the ideal (all work / slots) is what the launch order costs.

Orders: each backend's enumeration of its grid (Mosaic GPU: the Pallas grid
(heads, query tiles, batch) with the batch fastest; Triton: (query tiles, batch,
heads) with the query tiles fastest) with the query tiles increasing, or heaviest
first (`tfjax.ops.pallas.common.heavy_first`, what the kernels launch); and LPT,
every program sorted longest first regardless of its head (a bound: it would
launch all heads' last tiles together, giving up the K/V reuse in L2 of programs
of one head running side by side).

Not a measurement of a GPU: equal cost per visited tile (PARTIAL tiles cost more
in truth), no memory system, no launch latency, a fixed number of resident
programs. It isolates what the order alone costs; a lent GPU's `bench_attention.py
gpu` measures the kernels.
"""

from __future__ import annotations

import heapq

from common import Experiment

import numpy as np

from tfjax.ops import masks as M
from tfjax.ops.tiles import tile_tables

SMS = 132  # H100 SXM / H200
# (kernel, query tile, kv tile, programs per SM at H=128) of the defaults
KERNELS = (("hopper fwd", 128, 128, 1), ("triton fwd", 128, 64, 2))


def makespan(works, slots: int) -> float:
    """Finish time of greedy list scheduling of `works` (in launch order) on `slots`."""
    free = [0.0] * slots
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + float(w))
    return max(free)


def row_work(mask, S: int, bq: int, bk: int) -> np.ndarray:
    """Visited kv tiles per query tile (one batch row of the mask)."""
    return np.asarray(tile_tables(mask, S, S, bq, bk).count)[0]


def launch(work: np.ndarray, kernel: str, B: int, N: int, heavy_first: bool) -> np.ndarray:
    """Programs' work in the order the backend starts them."""
    tiles = work[::-1] if heavy_first else work
    if kernel.startswith("hopper"):  # grid (N, nq, B): batch fastest
        return np.repeat(np.tile(tiles, N), B)
    return np.tile(tiles, B * N)  # Triton grid (nq, B, N): query tiles fastest


def main(argv=None):
    exp = Experiment("launch_order", __doc__, argv=argv)
    lengths = (2048, 4096) if exp.quick else (2048, 4096, 8192, 16384, 32768)
    shapes = ((1, 32), (1, 8)) if exp.quick else ((1, 32), (4, 32), (1, 8))
    masks = {"causal": M.causal(), "window 1k": M.sliding_window(1024)}
    rows, curves = [], {}
    for (kernel, bq, bk, per_sm), (mname, mask), (B, N), S in (
            (k, m, s, S) for k in KERNELS for m in masks.items() for s in shapes
            for S in lengths):
        work = row_work(mask, S, bq, bk)
        slots = SMS * per_sm
        ideal = work.sum() * B * N / slots
        inc = makespan(launch(work, kernel, B, N, False), slots) / ideal
        rev = makespan(launch(work, kernel, B, N, True), slots) / ideal
        lpt = makespan(np.sort(np.tile(work, B * N))[::-1], slots) / ideal
        rows.append([kernel, mname, B, N, S, len(work) * B * N, round(inc, 3), round(rev, 3),
                     round(lpt, 3), round(inc / rev, 3)])
        if mname == "causal" and (B, N) == (1, 32):
            for label, v in ((f"{kernel}, increasing", inc), (f"{kernel}, heaviest first", rev)):
                curves.setdefault(label, ([], []))
                curves[label][0].append(S)
                curves[label][1].append(v)
    exp.text(f"{SMS} SMs; slots = SMs x programs per SM (Hopper forward 1, Triton forward 2). "
             "Columns: makespan / ideal for each order; gain = increasing / heaviest first.")
    exp.table(["kernel", "mask", "B", "N", "S", "programs", "increasing", "heaviest first",
               "LPT (bound)", "gain"], rows, title="Makespan over the ideal, by launch order")
    exp.plot(curves, xlabel="S (tokens)", ylabel="makespan / ideal", logx=True,
             title="Causal forward, B=1, N=32: launch order")
    exp.finish()


if __name__ == "__main__":
    main()
