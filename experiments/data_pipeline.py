"""Token caches against tokenizing on the fly: prepare throughput, loader speed, the
trainer's wait for data, and a mixture's realised shares (issue 46, item 7).

1. `tfjax.data.prepare.prepare` (what `python -m tfjax.data.prepare` runs) on a corpus
   made here from the standard library's .py files, as text files and as one jsonl,
   with the byte tokenizer and a BPE trained on the same corpus
   (`tfjax.data.tokenizer.train`): MB/s and tokens/s against `--workers` 1 and 2 (wall
   time of the call, worker start-up included), best of the rounds.
2. The loader's tokens per second of its own thread's CPU time (one core): a two-cache
   `MixtureBatches` (the rows of one process) against `PackedBatches` over the same
   documents (tokenized on the fly, the peer), at the default preset's batch and at a
   1B shape's per-host batch, each against what the train step consumes.
3. `time_data_s` (the trainer's wait for the next batch, metrics.jsonl) of short runs of
   the default preset with `data.source="cache"` against `data.source="text"` over the
   same documents, same seed, in alternating order.
4. A three-cache mixture with staged weights (`MixturePlan`): each source's rows per
   block against the target share, and the long-run share against the weights.

Results: experiments/results/data_pipeline.md (`--quick`: data_pipeline_quick.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import HERE, Experiment

ROOT = os.path.dirname(HERE)

# The 1B point of results/vs_maxtext.md: Llama-3.2-1B, 8 rows x 2048 tokens on one host
# of v5p:2x2x1 (4 chips), tfjax's defaults (loss chunk 512, full remat): XLA's
# optimal_seconds of the step, read from that table.
ONE_B = dict(seq_len=2048, rows=8, step_s=19.72e-3, source="results/vs_maxtext.md, row "
             "1b_2k 512:full, XLA optimal_seconds")


def make_corpus(root: str, megabytes: float) -> dict:
    """Stdlib .py files that decode as UTF-8, into root/a or root/b (the smaller), until
    `megabytes`; and the same documents as root/corpus.jsonl ({"text": ...} lines). Each
    half gets a validation document (the trainer builds its validation split)."""
    from tfjax.data.sources import is_validation, stdlib_files

    total, n, sizes = 0, 0, {"a": 0, "b": 0}
    names: dict[str, list[str]] = {"a": [], "b": []}
    with open(os.path.join(root, "corpus.jsonl"), "w") as jl:
        for path in stdlib_files("train"):
            raw = open(path, "rb").read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not text.strip():
                continue
            half = min(sizes, key=sizes.get)
            name = f"{n:05d}_{os.path.basename(path)}"
            os.makedirs(os.path.join(root, half), exist_ok=True)
            with open(os.path.join(root, half, name), "wb") as f:
                f.write(raw)
            names[half].append(name)
            jl.write(json.dumps({"text": text}) + "\n")
            sizes[half] += len(raw)
            total, n = total + len(raw), n + 1
            if total >= megabytes * 2**20:
                break
    for half, files in names.items():  # names are relative to the half's directory
        if not any(is_validation(f) for f in files):
            k = next(k for k in range(10_000) if is_validation(f"val{k}_{files[0]}"))
            os.rename(os.path.join(root, half, files[0]),
                      os.path.join(root, half, f"val{k}_{files[0]}"))
    return dict(documents=n, bytes=total, text=[os.path.join(root, "a"), os.path.join(root, "b")],
                jsonl=[os.path.join(root, "corpus.jsonl")])


def train_bpe(root: str, inputs: list[str], vocab_size: int) -> str:
    from tfjax.data.tokenizer.train import train

    out = os.path.join(root, "bpe")
    return train(inputs, out, vocab_size, progress=False)


def time_prepare(inputs, tokenizer, workers, shard_mb, root) -> tuple[float, dict]:
    from tfjax.data.prepare import prepare

    out = tempfile.mkdtemp(dir=root, prefix="cache_")
    t0 = time.perf_counter()
    meta = prepare(inputs, out, tokenizer, workers=workers, shard_mb=shard_mb, progress=False)
    secs = time.perf_counter() - t0
    shutil.rmtree(out)
    return secs, meta


def startup_s(tokenizer, workers, root) -> float:
    """Wall time of a prepare whose work is nil: `workers` one-line files, one shard each,
    so `workers` workers are spawned (each imports tfjax and loads the tokenizer)."""
    tiny = tempfile.mkdtemp(dir=root, prefix="tiny_")
    for i in range(workers):
        with open(os.path.join(tiny, f"{i}.txt"), "w") as f:
            f.write("x = 1\n")
    secs, _ = time_prepare([tiny], tokenizer, workers, 1e-6, root)
    shutil.rmtree(tiny)
    return secs


def prepare_section(exp, corpus, toks, rounds, shard_mb, root) -> None:
    rows = []
    for tok_label, tok in toks.items():
        start = min(startup_s(tok, 2, root) for _ in range(rounds))
        for fmt_label in ("text", "jsonl"):
            best: dict[int, tuple[float, dict]] = {}
            order = (1, 2)
            for r in range(rounds):  # alternate which worker count goes first
                for w in (order if r % 2 == 0 else order[::-1]):
                    secs, meta = time_prepare(corpus[fmt_label], tok, w, shard_mb, root)
                    if w not in best or secs < best[w][0]:
                        best[w] = (secs, meta)
            for w in order:
                secs, meta = best[w]
                n_shards = len(meta["splits"]["train"]["shards"])
                work = secs - (start if w > 1 else 0.0)
                rows.append([tok_label, fmt_label, w, n_shards, meta["num_tokens"], secs,
                             corpus["bytes"] / 2**20 / secs, meta["num_tokens"] / secs,
                             best[1][0] / secs, start if w > 1 else 0.0,
                             corpus["bytes"] / 2**20 / work if work > 0 else float("nan"),
                             best[1][0] / work if work > 0 else float("nan")])
    exp.table(["tokenizer", "input", "workers", "shards", "tokens", "wall s", "MB/s",
               "tokens/s", "speed-up vs 1 worker", "worker start-up s",
               "MB/s after start-up", "speed-up after start-up"], rows,
              title=f"1. prepare throughput (best of {rounds}; {corpus['bytes'] / 2**20:.2f} "
                    f"MB of stdlib .py, {corpus['documents']:,} documents, --shard_mb "
                    f"{shard_mb:.3g})")
    exp.text("Wall time of `prepare(...)` (what `python -m tfjax.data.prepare` runs) in this "
             "process. With 1 worker the tokenizer runs in this process; with 2 the wall "
             "time includes spawning the workers (each imports tfjax and loads the "
             "tokenizer): 'worker start-up' is the best wall time of a 2-worker prepare of "
             "two one-line files, and 'after start-up' subtracts it. MB = 2^20 bytes of "
             "input files.")


def _loader_rate(it, tokens_per_batch: int, budget_s: float) -> tuple[float, float, int]:
    """(tokens per thread-CPU second, tokens per wall second, batches) after one warm-up
    batch (which opens and verifies the caches' shards)."""
    next(it)
    n, c0, w0 = 0, time.thread_time(), time.perf_counter()
    while n < 3 or time.thread_time() - c0 < budget_s:
        next(it)
        n += 1
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    return n * tokens_per_batch / cpu, n * tokens_per_batch / wall, n


def loader_section(exp, corpus, caches, shapes, budget_s) -> None:
    from tfjax.config import DataConfig
    from tfjax.data.mixture import MixtureBatches, open_caches
    from tfjax.data.pipeline import PackedBatches
    from tfjax.data.sources import documents
    from tfjax.data.tokenizer import load_tokenizer

    rows = []
    for tok_label, (tok_name, paths) in caches.items():
        tok = load_tokenizer(tok_name)
        cache_data = DataConfig(source="cache", paths=tuple(paths), tokenizer=tok_name)
        text_data = DataConfig(source="text", paths=tuple(os.path.join(p, "*")
                                                           for p in corpus["text"]))
        for label, shape in shapes.items():
            T, B, need = shape["seq_len"], shape["rows"], shape["need"]
            make = {
                "cache mixture (MixtureBatches)": lambda: MixtureBatches(
                    open_caches(cache_data, "train"), tok, seq_len=T, global_batch=B,
                    weights=(1, 1), block_rows=2048, seed=0),
                "on the fly (PackedBatches)": lambda: PackedBatches(
                    documents(text_data, "train"), tok, seq_len=T, global_batch=B, seed=0),
            }
            got = {k: _loader_rate(f(), T * B, budget_s) for k, f in make.items()}
            peer = got["on the fly (PackedBatches)"][0]
            for k, (cpu_rate, wall_rate, n) in got.items():
                rows.append([tok_label, label, f"{B} x {T}", k, n, cpu_rate, wall_rate, need,
                             cpu_rate / need, cpu_rate / peer])
    exp.table(["tokenizer", "shape", "rows x seq_len", "loader", "batches", "tokens/s (1 core)",
               "tokens/s (wall)", "step needs tokens/s", "loader / step need",
               "vs on the fly"], rows,
              title="2. loader tokens/s against the train step's need")
    exp.text("tokens/s (1 core) = batches x rows x seq_len / the loader thread's CPU time "
             "(`time.thread_time`, what one core gives it whatever the machine's load); wall "
             "beside it. The cache mixture mixes two caches (the corpus' halves a and b, "
             "weights 1:1), reading all rows of one process; the peer packs the same "
             "documents (`data.source=\"text\"`) tokenizing on the fly. The issue's bar: "
             "loader / step need >= 10. Step needs: " + "; ".join(
                 f"{k}: {v['rows']} x {v['seq_len']} tokens per step / {v['step_s'] * 1e3:.4g} "
                 f"ms ({v['source']})" for k, v in shapes.items()))


def train_run(workdir: str, variant: str, overrides: list[str]) -> list[dict]:
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "tfjax.train", "--config", f"configs/default.py{variant}",
           "--workdir", workdir, "--config.train.progress=False", "--config.train.eval_every=0",
           "--config.train.eval_at_end=False", "--config.train.sample_tokens=0",
           "--config.checkpoint.enabled=False", "--config.seed=0", *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}"
                         f"{p.stderr[-2000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def trainer_section(exp, corpus, cache_paths, variant, train_over, rounds, root) -> dict:
    """Short runs, cache and text alternating; returns the measured step (s per step,
    tokens per step) for the loader table."""
    log_every = int(re.search(r"log_every=(\d+)", " ".join(train_over)).group(1))
    sources = {
        "text": ["--config.data.source=text", "--config.data.paths=(" + ", ".join(
            f"'{os.path.join(p, '*')}'" for p in corpus["text"]) + ",)"],
        "cache": ["--config.data.source=cache", "--config.data.paths=(" + ", ".join(
            f"'{p}'" for p in cache_paths) + ",)"],
    }
    per: dict[str, list] = {k: [] for k in sources}
    for r in range(rounds):
        for name in (("text", "cache") if r % 2 == 0 else ("cache", "text")):
            recs = train_run(os.path.join(root, f"run_{name}_{r}"), variant,
                             [*train_over, *sources[name]])
            later = [x for x in recs if "time_data_s" in x and "loss" in x][1:]  # after compile
            per[name].append(dict(
                data=sum(x["time_data_s"] for x in later) / (len(later) * log_every),
                step=sum(x["time_step_s"] for x in later) / (len(later) * log_every),
                wall=sum(x["wall_s"] for x in later) / (len(later) * log_every),
                loss=recs[-1]["loss"], steps=len(later) * log_every,
                shares={k.split("/", 1)[1]: v for k, v in recs[-1].items()
                        if k.startswith("data_tokens/")}))
    rows = []
    text_data = np.mean([x["data"] for x in per["text"]])
    for name, runs in per.items():
        for r, x in enumerate(runs):
            rows.append([name, r, x["steps"], x["data"] * 1e3, x["step"] * 1e3, x["wall"] * 1e3,
                         100 * x["data"] / x["wall"], x["data"] / text_data, x["loss"]])
    exp.table(["data.source", "round", "steps timed", "time_data ms / step",
               "time_step ms / step", "wall ms / step", "data % of wall",
               "time_data vs text (mean)", "loss at the end"], rows,
              title="3. the trainer's wait for data: cache against on the fly (text)")
    shares = per["cache"][-1]["shares"]
    exp.text(f"`python -m tfjax.train --config configs/default.py{variant} "
             f"{' '.join(train_over)} --config.seed=0` (eval, sample and checkpoints off), "
             "with `data.source=text` over the corpus' halves a/* and b/* or "
             "`data.source=cache` over their byte caches (weights () = by tokens); per step "
             f"over the logged intervals after the first (which holds the compile). "
             f"data_tokens at the end of the last cache run: {shares}.")
    step_s = float(np.median([x["step"] for runs in per.values() for x in runs]))
    return dict(step_s=step_s)


def mixture_section(exp, rows, stages, global_batch, block_rows, steps, show_blocks) -> None:
    from tfjax.data.mixture import MixturePlan

    plan = MixturePlan(rows, stages, global_batch=global_batch, block_rows=block_rows, seed=0)
    names = [f"s{i}" for i in range(len(rows))]
    starts = [s for s, _ in stages] + [steps]
    out, long_run = [], []
    for k, (start, weights) in enumerate(stages):
        w = np.asarray(weights, float) / sum(weights)
        got = np.array([plan.source_row(step, r)[0] for step in range(start, starts[k + 1])
                        for r in range(global_batch)])
        nblocks = -(-len(got) // block_rows)
        for b in range(nblocks):
            part = got[b * block_rows:(b + 1) * block_rows]
            if b < show_blocks or b == nblocks - 1:
                counts = np.bincount(part, minlength=len(rows))
                out.append([k, b, len(part), *counts, *(counts / len(part)).round(4),
                            " / ".join(f"{x:.4f}" for x in w),
                            float(np.abs(counts / len(part) - w).max())])
        counts = np.bincount(got, minlength=len(rows))
        draws = plan.draws(starts[k + 1]) - plan.draws(start)  # the log's exact counter
        assert (draws == counts).all(), (draws, counts)
        long_run.append([k, f"{start}-{starts[k + 1] - 1}", len(got), *counts,
                         *(counts / len(got)).round(5), " / ".join(f"{x:.5f}" for x in w),
                         float(np.abs(counts / len(got) - w).max())])
    exp.table(["stage", "block", "rows", *[f"{n} rows" for n in names],
               *[f"{n} share" for n in names], "target share", "max |share - target|"], out,
              title=f"4a. realised share per block (3 sources, {block_rows} rows per block, "
                    f"batch {global_batch}; the first {show_blocks} blocks and the last of "
                    f"each stage)")
    exp.table(["stage", "steps", "rows", *[f"{n} rows" for n in names],
               *[f"{n} share" for n in names], "weights", "max |share - weight|"], long_run,
              title="4b. long-run share per stage against the weights")
    exp.text(f"`MixturePlan(rows={tuple(rows)}, stages={stages}, global_batch={global_batch}, "
             f"block_rows={block_rows}, seed=0)`; each row's source from `source_row(step, "
             f"r)`, counted; the per-stage totals equal `draws(end) - draws(start)` (what "
             f"`data_tokens/<cache>` logs, x seq_len) exactly (asserted). A stage's last "
             f"block is cut short by the next stage (blocks restart at each stage).")


def main(argv=None):
    exp = Experiment("data_pipeline", __doc__, argv=argv)
    q = exp.quick
    load0 = os.getloadavg()
    exp.text(f"load average (1/5/15 min) at the start: {load0[0]:.2f} / {load0[1]:.2f} / "
             f"{load0[2]:.2f}; {os.cpu_count()} cores.")
    root = tempfile.mkdtemp(prefix="data_pipeline_")
    try:
        corpus = make_corpus(root, 0.25 if q else 16.0)
        exp.text(f"Corpus: {corpus['documents']:,} stdlib .py files, "
                 f"{corpus['bytes'] / 2**20:.2f} MB, as text files (two halves) and as one "
                 f"jsonl.")
        bpe = train_bpe(root, corpus["text"], 1024 if q else 8192)
        toks = {"byte": "byte", f"BPE {1024 if q else 8192}": bpe}
        shard_mb = corpus["bytes"] / 2**20 / 6
        prepare_section(exp, corpus, toks, 1 if q else 2, shard_mb, root)

        # Caches of the two halves for the loader and the trainer.
        from tfjax.data.prepare import prepare
        caches = {}
        for label, tok in toks.items():
            paths = []
            for half in corpus["text"]:
                out = os.path.join(root, "caches", label.split()[0].lower(),
                                   os.path.basename(half))
                prepare([half], out, tok, workers=1, shard_mb=shard_mb, progress=False)
                paths.append(out)
            caches[label] = (tok, paths)

        variant = ":tiny" if q else ""
        train_over = (["--config.train.steps=6", "--config.train.log_every=2",
                       "--config.train.batch_size=8", "--config.train.seq_len=32",
                       "--config.train.microbatches=1"] if q else
                      ["--config.train.steps=30", "--config.train.log_every=10"])
        step = trainer_section(exp, corpus, caches["byte"][1], variant, train_over,
                               1 if q else 2, root)

        from common import preset_config
        cfg = preset_config("default", "tiny" if q else None)
        B, T = (8, 32) if q else (cfg.train.batch_size, cfg.train.seq_len)
        shapes = {f"default preset{' :tiny' if q else ''}": dict(
                      seq_len=T, rows=B, step_s=step["step_s"],
                      source="section 3's median time_step_s per step, this CPU"),
                  "Llama-3.2-1B, one v5p host": dict(
                      seq_len=ONE_B["seq_len"], rows=ONE_B["rows"], step_s=ONE_B["step_s"],
                      source=ONE_B["source"])}
        for s in shapes.values():
            s["need"] = s["rows"] * s["seq_len"] / s["step_s"]
        loader_section(exp, corpus, caches, shapes, 0.2 if q else 3.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mixture_section(exp, rows=(5000, 3000, 1000),
                    stages=[(0, (5, 3, 2)), (40 if q else 400, (1, 1, 1))],
                    global_batch=32, block_rows=100 if q else 2048,
                    steps=60 if q else 1000, show_blocks=2 if q else 3)
    load1 = os.getloadavg()
    exp.text(f"load average (1/5/15 min) at the end: {load1[0]:.2f} / {load1[1]:.2f} / "
             f"{load1[2]:.2f}.")
    exp.finish()


if __name__ == "__main__":
    main()
