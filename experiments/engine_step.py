"""The inference engine's decode step alone, its pieces, and its costliest ops, on
experiments/bench_serve.py's model and engine (16 rows, pages of 16); or (`--part
serve`) whole engines on bench_serve.py's workload, A/B in one process.

    .venv/bin/python experiments/engine_step.py                      # widths 96, 288, 1024
    .venv/bin/python experiments/engine_step.py --widths 288 --ops 30 --hlo /tmp/step.hlo
    .venv/bin/python experiments/engine_step.py --variants auto:1,blockwise:1   # A/B
    .venv/bin/python experiments/engine_step.py --fill 0.5 --variants auto:1,auto:3
    .venv/bin/python experiments/engine_step.py --part serve --serve_variants sync:1,ragged:1
    .venv/bin/python experiments/engine_step.py --part serve --mla \
        --serve_variants async:1:16:16,ragged:1:16:16

For each `max_len` of `--widths` (a page table of max_len / 16 pages a row) an engine is
built, every row holding `--fill` of its pages, and these are timed, interleaved
(one repeat of each in turn, `--repeats` times; medians of the wall time and of the
process's CPU time), so that load from other jobs on a shared machine hits them alike:

- `step`: the engine's decode program (`programs.step(1, 0, ...)`: the model's paged
  step, sampling, the output counts), one engine per `--variants` item `impl:widths`
  (the model's `attention.impl`, `EngineConfig.table_widths`; compare variants only
  within one run);
- `model`: `model.step` over the paged cache alone (writes, gathers, attention, MLP);
- `sample greedy` / `sample full`: `sample_rows` alone on `[16, V]` logits, every row
  greedy / every row with temperature, top-k, top-p, min-p and penalties;
- `forward`: the model's uncached forward of one token a row (no cache at all);
- `dispatch`: a jitted call taking the step's arguments and computing nothing
  (flattening the parameters and the cache, the host's part).

`--ops N` profiles the step (`jax.profiler`) and prints the N costliest XLA ops of
the compiled program (time per step, shape, op), then the time summed per kind of op;
`--hlo F` writes the optimized HLO of the first width's step to F.

`--part serve`: bench_serve.py's engine run (its defaults: 48 requests, prompts
8..192, answers 4..96, 16 rows, runs of 64, 4 a step) by one engine per
`--serve_variants` item `dispatch:chunk_sizes[:chunk:prefill_rows]` (`ragged`: the
engine's step, prompt runs and decode tokens one call, read after the next step's call
is dispatched; `sync`: the same, each step's call read before the next is dispatched;
`async`: a call for each kind (`ragged=False`); `EngineConfig.chunk_sizes`, `chunk`,
`prefill_rows`), `--repeats` runs of each in turn after one to warm up; `--mla`:
the model's layers DeepSeek's latent attention (`async` against `ragged`: MLA's
latent pages read once a run). Printed per variant (medians over the runs): output
tokens/s, time to first token p50 / p99, inter-token p50, and where a run's wall time goes on the host: in the prefill
(chunk; ragged: the steps' one) calls and in the decode calls (preparing and
dispatching each, waiting for its results and taking them), and the rest of the step
(admission, bookkeeping); the process's CPU time of a run (every thread: the work done, which other
jobs on a shared machine inflate less than the wall time); ratios to the first variant.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.bench_serve import bench_model, drive  # noqa: E402
from experiments.common import markdown_table  # noqa: E402
from tfjax.inference.engine import Engine, EngineConfig  # noqa: E402
from tfjax.inference.sampling import SamplingParams, sample_rows  # noqa: E402

ROWS, PAGE = 16, 16
FULL = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
            presence_penalty=0.5, frequency_penalty=0.2)


def decode_engine(width: int, fill: float, impl: str, widths: int, args
                  ) -> tuple[Engine, callable]:
    """An engine of max_len `width` whose rows hold `fill` of their pages, and a
    function running its decode program once (greedy rows)."""
    model = bench_model(args.d_model, args.layers, args.vocab, width, attention_impl=impl)
    engine = Engine(model, EngineConfig(max_seqs=ROWS, max_len=width, page_size=PAGE, chunk=64,
                                        prefix_caching=False, table_widths=widths))
    size = engine.global_size
    pages = size // PAGE
    held = max(1, int(round(fill * pages)))
    table = np.zeros((ROWS, pages), np.int32)
    table[:, :held] = 1 + np.arange(ROWS * held, dtype=np.int32).reshape(ROWS, held)
    engine.tables[size][:] = table
    engine._tables_on_device = None
    length = np.full(ROWS, held * PAGE - 1, np.int32)
    tokens = np.ones((ROWS, 1), np.int32)
    ones = np.ones(ROWS, np.int32)
    sampling = jax.device_put(SamplingParams.padding(ROWS))
    program = engine._programs.step(1, 0, 0, False, engine._narrow(held))
    call = lambda: (engine.params, engine.cache, engine.seen, engine.counts, engine.last,  # noqa
                    None, tokens, ones, length, engine._device_tables(), sampling, length + 1,
                    ones.astype(bool), np.full((ROWS, 1), -1, np.int32))

    def step():
        out, _, engine.cache, engine.counts, engine.last = program(*call())
        return out.tokens

    step.program, step.arguments = program, call
    return engine, step


def pieces(engine: Engine, step, args) -> dict:
    """The timed functions of one engine (see the module docstring)."""
    graphdef, params = engine.graphdef, engine.params
    tables = engine._device_tables()
    length = jnp.asarray(step.arguments()[8])

    @jax.jit
    def model_step(params, cache, tokens):
        model = nnx.merge(graphdef, params)
        cache = cache.replace(length=length, pages=cache.pages.replace(tables=tables))
        return model.step(tokens, cache, jnp.ones(ROWS, jnp.int32))[0]

    @jax.jit
    def forward(params, tokens):
        return nnx.merge(graphdef, params)(tokens)

    V = engine.vocab_size
    logits = jax.random.normal(jax.random.key(0), (ROWS, V)) * 3
    seen = jnp.zeros((ROWS, V), bool).at[:, :50].set(True)
    counts = jnp.zeros((ROWS, V), jnp.int32).at[:, 10:20].set(2)
    positions = jnp.arange(ROWS, dtype=jnp.int32) + 100
    sample = jax.jit(sample_rows)
    greedy = jax.device_put(SamplingParams.padding(ROWS))
    full = jax.device_put(SamplingParams.of([dict(FULL, seed=b) for b in range(ROWS)]))
    nothing = jax.jit(lambda *a: jnp.zeros(()))
    tokens = jnp.ones((ROWS, 1), jnp.int32)
    return {
        "model": lambda: model_step(params, engine.cache, tokens),
        "sample greedy": lambda: sample(logits, greedy, positions, seen, counts).tokens,
        "sample full": lambda: sample(logits, full, positions, seen, counts).tokens,
        "forward": lambda: forward(params, tokens),
        "dispatch": lambda: nothing(*step.arguments()),
    }


def timed(fns: dict, repeats: int) -> dict:
    """Median (wall, CPU) seconds of each function, run in turn `repeats` times after a
    warm-up. The CPU time (the process's, every thread) counts the work done, which
    other jobs on the cores inflate less than the wall time."""
    for f in fns.values():
        jax.block_until_ready(f())
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(f())
            times[k].append((time.perf_counter() - t, time.process_time() - c))
    return {k: tuple(np.median(np.asarray(v), axis=0)) for k, v in times.items()}


def op_profile(step, repeats: int, top: int) -> None:
    """Print the `top` costliest XLA ops of the step's program, per step, and per kind."""
    hlo = step.program.lower(*step.arguments()).compile().as_text()
    ops = {m.group(1): (m.group(2), m.group(3))
           for m in re.finditer(r"%(\S+) = (\S+) (\w[\w-]*)\(", hlo)}
    jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(repeats):
                jax.block_until_ready(step())
        data = jax.profiler.ProfileData.from_file(
            glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    spent, calls = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in ops:
                    spent[ev.name] += ev.duration_ns / repeats / 1e3
                    calls[ev.name] += 1 / repeats
    total = sum(spent.values())
    print(f"\nops of the step: {total:.0f} us a step summed over threads, {len(spent)} ops run")
    rows = [[f"{us:.0f}", f"{calls[name]:.0f}", name, *ops[name]]
            for name, us in spent.most_common(top)]
    print(markdown_table(["us / step", "calls", "op", "shape", "kind"], rows))
    kinds = collections.Counter()
    for name, us in spent.items():
        kinds[re.sub(r"(_fusion)?(\.\d+)?$", "", name)] += us
    print(markdown_table(["kind", "us / step", "share"],
                         [[k, f"{us:.0f}", f"{us / total:.2f}"] for k, us in kinds.most_common()]))


class _SyncEngine(Engine):
    """The engine as it was before a step read the calls of the step before it: a
    step's calls are read before it returns (the `sync` variant)."""

    def step(self):
        out = Engine.step(self)
        done, self._in_flight = self._in_flight, []
        return out + [o for call in done for o in self._finish(*call)]


def serve_engines(args) -> None:
    """`--part serve` (see the module docstring)."""
    from experiments.bench_serve import workload

    bench = argparse.Namespace(requests=48, max_prompt=192, max_new=96, max_seqs=16,
                               page_size=PAGE, chunk=64, prefill_rows=4, seed=0,
                               answers="uniform")
    max_len = bench.max_prompt + bench.max_new
    mla = dict(kv_lora_rank=64, q_lora_rank=0, qk_rope_head_dim=16, qk_nope_head_dim=48,
               v_head_dim=64) if args.mla else None
    model = bench_model(args.d_model, args.layers, args.vocab, max_len, mla=mla)
    prompts, new = workload(argparse.Namespace(**vars(bench), vocab=args.vocab))
    variants = args.serve_variants.split(",")
    calls = collections.defaultdict(float)

    def engine_of(variant):
        dispatch, sizes, *shape = variant.split(":")
        chunk, rows = map(int, shape) if shape else (bench.chunk, bench.prefill_rows)
        kind = _SyncEngine if dispatch == "sync" else Engine
        engine = kind(model, EngineConfig(max_seqs=bench.max_seqs, max_len=max_len,
                                          page_size=PAGE, chunk=chunk, prefill_rows=rows,
                                          prefix_caching=False, chunk_sizes=int(sizes),
                                          ragged=dispatch != "async"))
        finish = engine._finish

        def timed(launch):  # a chunk or ragged call (T > 1) counts as prefill
            def timed_launch(group, T, *decoding):
                start = time.perf_counter()
                call = launch(group, T, *decoding)
                calls["prefill" if T > 1 else "decode"] += time.perf_counter() - start
                return T, call
            return timed_launch

        def timed_finish(T, call):
            start = time.perf_counter()
            out = finish(*call)
            calls["prefill" if T > 1 else "decode"] += time.perf_counter() - start
            return out

        engine._launch, engine._launch_ragged = timed(engine._launch), timed(engine._launch_ragged)
        engine._finish = lambda *c: timed_finish(*c)
        engine.warm_up()
        return engine

    def run(engine):
        calls.clear()
        c0 = time.process_time()
        r = drive(engine, prompts, new)
        wall, cpu, gaps = r["wall"], time.process_time() - c0, r["gaps"]
        ttft = np.asarray(r["first"]) - r["t0"]
        return (dict(tps=sum(new) / wall, ttft50=np.percentile(ttft, 50) * 1e3,
                     ttft99=np.percentile(ttft, 99) * 1e3, itl50=np.percentile(gaps, 50) * 1e3,
                     wall=wall, cpu=cpu, prefill=calls["prefill"], decode=calls["decode"],
                     host=wall - calls["prefill"] - calls["decode"]),
                r["tokens"])

    engines = {v: engine_of(v) for v in variants}
    outputs = {v: run(e)[1] for v, e in engines.items()}  # a run to warm up each
    same = all(o == outputs[variants[0]] for o in outputs.values())
    results = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v, e in engines.items():
            results[v].append(run(e)[0])
    keys = ["tps", "ttft50", "ttft99", "itl50", "wall", "cpu", "prefill", "decode", "host"]
    med = {v: {k: float(np.median([r[k] for r in rs])) for k in keys} for v, rs in results.items()}
    ref = med[variants[0]]
    rows = [[v, f"{m['tps']:.0f}", f"{m['tps'] / ref['tps']:.2f}", f"{m['ttft50']:.0f}",
             f"{m['ttft50'] / ref['ttft50']:.2f}", f"{m['ttft99']:.0f}", f"{m['itl50']:.1f}",
             f"{m['wall']:.2f}", f"{m['cpu']:.2f}", f"{m['prefill']:.2f}", f"{m['decode']:.2f}", f"{m['host']:.2f}"]
            for v, m in med.items()]
    print(markdown_table(["variant (dispatch:chunk_sizes)", "output tok/s", "x first",
                          "TTFT p50 ms", "x first", "TTFT p99 ms", "ITL p50 ms", "wall s",
                          "CPU s", "prefill calls s", "decode calls s", "other host s"], rows))
    print(f"greedy tokens of every variant equal: {same}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="96,288,1024", help="max_len of each engine")
    ap.add_argument("--fill", type=float, default=1.0, help="share of a row's pages held")
    ap.add_argument("--variants", default="auto:3",
                    help="engines to compare: attention.impl:EngineConfig.table_widths, ...")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ops", type=int, default=0, help="print the N costliest ops")
    ap.add_argument("--hlo", default="", help="write the first step's optimized HLO here")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--part", choices=("decode", "serve"), default="decode")
    ap.add_argument("--serve_variants", default="sync:1,ragged:1",
                    help="--part serve: engines to compare, "
                         "(sync|async|ragged):chunk_sizes[:chunk:prefill_rows]")
    ap.add_argument("--mla", action="store_true",
                    help="--part serve: every layer latent attention (rank 64, rope 16)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if args.part == "serve":
        print(f"{jax.devices()[0].platform}, {os.cpu_count()} cores, load average {load:.1f}; "
              f"bench_serve.py's workload, medians of {args.repeats} runs of each variant")
        serve_engines(args)
        print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
        return
    print(f"{jax.devices()[0].platform}, {os.cpu_count()} cores, load average {load:.1f}; "
          f"{ROWS} rows, pages of {PAGE}, {args.fill:.0%} of each row's pages held")
    rows = []
    for width in map(int, args.widths.split(",")):
        engines = {v: decode_engine(width, args.fill, v.split(":")[0], int(v.split(":")[1]),
                                    args) for v in args.variants.split(",")}
        first = next(iter(engines.values()))
        fns = {f"step ({v})": step for v, (_, step) in engines.items()}
        fns.update(pieces(*first, args))
        for name, (wall, cpu) in timed(fns, args.repeats).items():
            rows.append([width, name, f"{wall * 1e3:.2f}", f"{cpu * 1e3:.2f}"])
        if args.hlo:
            _, step = first
            with open(args.hlo, "w") as f:
                f.write(step.program.lower(*step.arguments()).compile().as_text())
            args.hlo = ""
        if args.ops:
            print(f"\nmax_len {width} ({args.variants.split(',')[0]}):")
            op_profile(first[1], 10, args.ops)
    print()
    print(markdown_table(["max_len", "timed", "wall ms (median)", "CPU ms (median)"], rows))
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
