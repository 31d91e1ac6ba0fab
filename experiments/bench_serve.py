"""The inference engine on a mixed-length workload, against static-batch `generate` and
against transformers' own continuous batching, on the same model and machine.

    .venv/bin/python experiments/bench_serve.py            # ~3 min on 2 CPU cores
    .venv/bin/python experiments/bench_serve.py --requests 96 --max_seqs 32 --d_model 512
    .venv/bin/python experiments/bench_serve.py --out experiments/results/bench_serve.md
    .venv/bin/python experiments/bench_serve.py --answers exponential --max_new 384  # chat-like

One random Llama-shaped model (layers unrolled, as decoding wants them), exported to a
Hugging Face directory and loaded by transformers (the same weights; float32). The
workload: --requests prompts of random lengths (8 .. --max_prompt tokens) asking for
random numbers of tokens (4 .. --max_new; `--answers` uniform, or exponential: a long
tail), EOS ignored, all submitted at once (an offline batch). Each system runs it once
to compile / warm up; then `--repeats` rounds each run every system once, in an order
rotated each round, so that the ratios compare runs made within seconds of each other
(a shared machine's speed drifts over minutes, all systems alike; see
experiments/results/bench_serve.md):

- tfjax engine: `tfjax.inference.engine.Engine` (`--max_seqs` rows, pages of
  `--page_size`, up to `--prefill_rows` runs of `--chunk` prompt tokens a step (16 x
  16: a prompt's last run pads less than with runs of 64, 1.01-1.09x tokens/s in
  `engine_step.py --part serve` A/Bs), prefill calls of `--chunk_sizes` widths; every
  step shape compiled first by `warm_up`), every output timed as `step()` returns it;
- tfjax static batches: `tfjax.inference.stream` over batches of `--max_seqs` requests
  in order, in one compiled shape (as a static server has): prompts right-padded to
  --max_prompt, a batch generating until its longest answer is done (the tokens past
  a request's own count are wasted), timed per step;
- transformers continuous batching: `model.init_continuous_batching` with
  `max_requests_per_batch=--max_seqs`, per-request `max_new_tokens`, the tokens'
  own timestamps; torch on every core (faster than one thread here).

`--xla_flags` is appended to XLA_FLAGS for both tfjax systems (e.g.
`--xla_cpu_multi_thread_eigen=false`; experiments/results/bench_serve.md has its A/B).

Printed (each system's run of median wall time): output tokens/s (the tokens the
requests asked for, over the wall time from submission to the last token; and every
run's), its ratio to the engine's (the median of the rounds' ratios; and every
round's), time to first token (p50, p99; from submission, so it includes waiting for a
slot), inter-token latency (p50, p99 over every gap between a request's consecutive
tokens); then the positions static batches compute against the requests' own tokens
(the most scheduling alone saves: an aim on the ratio is read against it) and the
engine's steps; the KV memory the engine's pages held at most against the static cache
of `--max_seqs` rows of the longest sequence. Greedy tokens of the three are checked equal
on the first requests. `--out F` also appends the table to F (markdown) under a dated
heading with the command and the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import markdown_table
from tfjax import models
from tfjax.config import model_config
from tfjax.inference import stream
from tfjax.inference.engine import Engine, EngineConfig, Request
from tfjax.interop import hf


def bench_model(d_model: int, layers: int, vocab: int, max_len: int, attention_impl="auto",
                mla: dict | None = None):
    """The benchmark's random Llama-shaped model (heads of 64, half as many kv heads,
    layers unrolled; `attention_impl`: its `attention.impl`; `mla`: every layer DeepSeek's
    latent attention of these `MLAConfig` fields instead)."""
    latent = dict(layer_pattern=("mla",), mla=mla) if mla else {}
    cfg = model_config(dict(vocab_size=vocab, d_model=d_model, num_layers=layers,
                            num_heads=d_model // 64, num_kv_heads=max(1, d_model // 128),
                            d_ff=4 * d_model, max_len=max_len, norm="rmsnorm", scan_layers=False,
                            activation="swiglu", position="rope", tie_embeddings=False,
                            init_std=0.5, attention=dict(impl=attention_impl), **latent))
    return models.build(cfg, rngs=nnx.Rngs(0))


def workload(args):
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, args.vocab, rng.integers(8, args.max_prompt + 1)).tolist()
               for _ in range(args.requests)]
    if args.answers == "uniform":
        new = rng.integers(4, args.max_new + 1, args.requests)
    else:  # most answers short, a few long (as served chat answers are)
        new = np.round(rng.exponential(args.max_new / 4, args.requests))
        new = np.clip(new, 4, args.max_new)
    return prompts, new.astype(int).tolist()


def latencies(first, gaps, t0):
    ttft = np.asarray([f - t0 for f in first])
    gaps = np.asarray(gaps) if gaps else np.zeros(1)
    return (np.percentile(ttft, 50), np.percentile(ttft, 99), np.percentile(gaps, 50),
            np.percentile(gaps, 99))


def run_engine(model, prompts, new, args):
    engine = Engine(model, EngineConfig(max_seqs=args.max_seqs, max_len=args.max_len,
                                        page_size=args.page_size, chunk=args.chunk,
                                        prefill_rows=args.prefill_rows, prefix_caching=False,
                                        chunk_sizes=args.chunk_sizes))
    engine.warm_up()
    run = drive(engine, prompts, new)
    return dict(wall=run["wall"], lat=latencies(run["first"], run["gaps"], run["t0"]),
                tokens=run["tokens"], kv_bytes=run["peak_pages"] * engine.page_bytes(model),
                steps=run["steps"])


def drive(engine, prompts, new) -> dict:
    """Submit greedy requests (prompt i, `new[i]` tokens, no EOS stop) and step `engine`
    until it is done: `t0`, `wall`, each request's first-token time (`first`,
    perf_counter), the inter-token gaps, the tokens in request order, the most pages
    held at once, the engine steps taken."""
    reqs = [Request(p, max_tokens=n, ignore_eos=True, sampling=dict(temperature=0))
            for p, n in zip(prompts, new)]
    last, first, gaps, tokens, peak = {}, {}, [], {r.request_id: [] for r in reqs}, 0
    steps, t0 = 0, time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        outs, steps = engine.step(), steps + 1
        now = time.perf_counter()
        peak = max(peak, engine.pages_in_use())
        for o in outs:
            if o.token is None:
                continue
            tokens[o.request_id].append(o.token)
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            else:
                first[o.request_id] = now
            last[o.request_id] = now
    return dict(t0=t0, wall=time.perf_counter() - t0, first=list(first.values()), gaps=gaps,
                tokens=[tokens[r.request_id] for r in reqs], peak_pages=peak, steps=steps)


def work(prompts, new, args) -> str:
    """What static batches compute against the requests' own tokens (each prompt and
    each answer token but the last, the least any system runs through the model): the
    most a scheduler saves at equal cost per position, so the ratio a throughput aim
    can be read against."""
    own = sum(len(p) + n - 1 for p, n in zip(prompts, new))
    longest = [max(new[b:b + args.max_seqs]) for b in range(0, len(new), args.max_seqs)]
    positions = sum(args.max_seqs * (args.max_prompt + n - 1) for n in longest)
    return (f"Work: static batches compute {positions} positions ({args.max_seqs} rows of "
            f"{args.max_prompt} prompt tokens and their batch's longest answer) for the "
            f"requests' {own} tokens ({positions / own:.2f}x), in {sum(longest)} calls (a "
            f"prefill and a decode step per token of each batch's longest answer)")


def run_static(model, prompts, new, args):
    """Fixed shapes (one compilation, as a static server has): every batch --max_seqs
    rows of --max_prompt tokens with room for --max_new, generating until its longest
    answer is done."""
    first, gaps, out = [], [], []
    t0 = time.perf_counter()
    for b in range(0, len(prompts), args.max_seqs):
        ps, ns = prompts[b:b + args.max_seqs], new[b:b + args.max_seqs]
        ids = np.zeros((args.max_seqs, args.max_prompt), np.int32)
        lengths = np.ones(args.max_seqs, np.int32)
        for i, p in enumerate(ps):
            ids[i, :len(p)], lengths[i] = p, len(p)
        rows, last = [[] for _ in ps], None
        for step in stream(model, jnp.asarray(ids), max_new_tokens=args.max_new,
                           prompt_lengths=jnp.asarray(lengths)):
            step = np.asarray(step)
            now = time.perf_counter()
            for i in range(len(ps)):
                if len(rows[i]) < ns[i]:
                    rows[i].append(int(step[i]))
                    if len(rows[i]) == 1:
                        first.append(now)
                    else:
                        gaps.append(now - last)
            last = now
            if all(len(r) == n for r, n in zip(rows, ns)):
                break  # the batch's longest answer is done
        out.extend(rows)
    return dict(wall=time.perf_counter() - t0, lat=latencies(first, gaps, t0), tokens=out)


class TransformersCB:
    """transformers' continuous batching on the model exported to `path`: one manager,
    started on entering and stopped on leaving; `run(prompts, new)` times one round."""

    def __init__(self, path: str, args):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(os.cpu_count() or 1)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        gen = GenerationConfig(do_sample=False, max_new_tokens=args.max_new, eos_token_id=None,
                               pad_token_id=0)
        cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_seqs,
                                      page_size=args.page_size)
        self.manager = model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cb)

    def __enter__(self):
        self.manager.start()
        return self

    def __exit__(self, *exc):
        self.manager.stop(block=True)

    def run(self, prompts, new) -> dict:
        t0 = time.perf_counter()
        ids = [self.manager.add_request(p, max_new_tokens=n, record_timestamps=True)
               for p, n in zip(prompts, new)]
        results = {}
        while len(results) < len(ids):
            r = self.manager.get_result(timeout=60)
            if r is not None and r.is_finished():
                results[r.request_id] = r
        wall = max(r.lifespan[1] for r in results.values()) - t0
        first, gaps = [], []
        for r in results.values():
            ts = r.timestamps or []
            if ts:
                first.append(ts[0])
                gaps.extend(np.diff(ts).tolist())
        return dict(wall=wall, lat=latencies(first, gaps, t0),
                    tokens=[results[i].generated_tokens for i in ids])


def rounds(runners: dict, prompts, new, repeats: int) -> dict:
    """Warm each of `runners` ({name: run(prompts, new) -> dict}) up on the workload,
    then `repeats` rounds running each once, the order rotated a place each round:
    {name: [its runs, round by round]}."""
    names, runs = list(runners), {name: [] for name in runners}
    for name in names:
        runners[name](prompts, new)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(runners[name](prompts, new))
            print(f"round {r + 1}: {name} {sum(new) / runs[name][-1]['wall']:.0f} tok/s",
                  flush=True)
    return runs


def median_run(runs: list[dict], engine_runs: list[dict]) -> dict:
    """The run of median wall time (its latencies with it), every run's wall, and the
    ratios of the engine's wall to this system's, round by round."""
    ordered = sorted(runs, key=lambda r: r["wall"])
    return dict(ordered[(len(ordered) - 1) // 2], walls=[r["wall"] for r in runs],
                ratios=[e["wall"] / r["wall"] for e, r in zip(engine_runs, runs)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max_prompt", type=int, default=192)
    ap.add_argument("--max_new", type=int, default=96)
    ap.add_argument("--max_seqs", type=int, default=16)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--prefill_rows", type=int, default=16)
    ap.add_argument("--chunk_sizes", type=int, default=EngineConfig.chunk_sizes,
                    help="EngineConfig.chunk_sizes: --chunk and its halvings")
    ap.add_argument("--answers", choices=("uniform", "exponential"), default="uniform",
                    help="answer lengths: uniform in 4..--max_new, or exponential with mean "
                         "--max_new / 4 clipped to 4..--max_new (a long tail)")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds, each timing every system once (the median's row is printed)")
    ap.add_argument("--skip", default="", help="comma list of: static, transformers")
    ap.add_argument("--xla_flags", default="",
                    help="appended to XLA_FLAGS (both tfjax systems), e.g. "
                         "--xla_cpu_multi_thread_eigen=false")
    ap.add_argument("--out", default="", help="append the results to this markdown file")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
    args.max_len = args.max_prompt + args.max_new
    model = bench_model(args.d_model, args.layers, args.vocab, args.max_len)
    prompts, new = workload(args)
    skip = set(filter(None, args.skip.split(",")))
    setting = (f"{jax.devices()[0].platform}, {os.cpu_count()} cores; {args.requests} requests, "
               f"prompts 8..{args.max_prompt}, answers 4..{args.max_new} tokens ({args.answers}), "
               f"{args.max_seqs} at once; {args.repeats} rounds (each system's median run); "
               f"XLA_FLAGS={os.environ['XLA_FLAGS'] or '(none)'}")
    print(setting, flush=True)
    runners = {"tfjax engine": lambda p, n: run_engine(model, p, n, args)}
    if "static" not in skip:
        runners["tfjax static generate"] = lambda p, n: run_static(model, p, n, args)
    with contextlib.ExitStack() as stack:
        if "transformers" not in skip:
            path = stack.enter_context(tempfile.TemporaryDirectory())
            hf.export(model, path)
            runners["transformers continuous batching"] = stack.enter_context(
                TransformersCB(path, args)).run
        runs = rounds(runners, prompts, new, args.repeats)
    results = {name: median_run(r, runs["tfjax engine"]) for name, r in runs.items()}
    total = sum(new)
    ref = results["tfjax engine"]
    rows = []
    for name, r in results.items():
        tps = total / r["wall"]
        t50, t99, i50, i99 = r["lat"]
        rows.append([name, f"{tps:.1f}", " / ".join(f"{total / w:.0f}" for w in r["walls"]),
                     f"{np.median(r['ratios']):.2f}",
                     " / ".join(f"{x:.2f}" for x in r["ratios"]), f"{t50 * 1e3:.0f}",
                     f"{t99 * 1e3:.0f}", f"{i50 * 1e3:.1f}", f"{i99 * 1e3:.1f}"])
        agree = np.mean([a[:5] == b[:5] for a, b in zip(ref["tokens"][:8], r["tokens"][:8])])
        rows[-1].append(f"{agree:.2f}")
    table = markdown_table(["system", "output tok/s", "each run", "x engine",
                            "x engine each round", "TTFT p50 ms",
                            "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                            "greedy agree (8 req x 5 tok)"], rows)
    static_bytes = jax.eval_shape(lambda: model.init_cache(args.max_seqs, args.max_len))
    static_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(static_bytes.layers))
    memory = (f"KV memory: engine pages held at most {ref['kv_bytes'] / 2**20:.2f} MiB; static "
              f"cache of {args.max_seqs} rows x {args.max_len} tokens "
              f"{static_bytes / 2**20:.2f} MiB ({ref['kv_bytes'] / static_bytes:.2f}x)")
    summary = f"{work(prompts, new, args)}; the engine in {ref['steps']} steps.\n\n{memory}"
    print(table)
    print(f"\n{summary}")
    if args.out:
        write_results(args.out, started, load, setting, table, summary)


def write_results(path: str, started, load: float, setting: str, table: str, summary: str):
    """Append a run's table to the markdown file `path`: a heading with the date, the
    exact command, the load average at the start and the end (a shared machine's
    figures are read against it), the table and the `summary` (the work, the KV memory)."""
    command = ".venv/bin/python " + " ".join(map(shlex.quote, sys.argv))
    with open(path, "a") as f:
        f.write(f"\n## bench_serve.py, {started:%Y-%m-%d %H:%M} UTC\n\n`{command}`\n\n"
                f"{setting}; load average {load:.1f} at the start, "
                f"{os.getloadavg()[0]:.1f} at the end.\n\n{table}\n\n{summary}\n")
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
