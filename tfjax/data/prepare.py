"""`python -m tfjax.data.prepare INPUT... --output DIR --tokenizer TOK [--field text]
[--workers N] [--shard_mb M]`: tokenize the inputs once into a token cache
(`tfjax.data.cache`), in worker processes, with a progress bar on a terminal.

Shards follow a plan fixed by the inputs and `--shard_mb`, so a killed prepare resumes:
finished shards whose checksums verify are kept, the others written again. A finished
cache of the same inputs and tokenizer is left as it is; other inputs, field or tokenizer
into the same DIR are refused. See docs/data.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue as queue_lib
import sys
import time
from collections.abc import Sequence

from tfjax import storage
from tfjax.data.cache import (FORMAT_VERSION, SPLITS, WRITER_OPTIONS, ShardWriter,
                              finished_shard, ids_dtype, write_json)
from tfjax.data.inputs import Input, Piece, find_inputs, pieces, read_piece
from tfjax.data.sources import is_validation
from tfjax.data.tokenizer import load_tokenizer

__all__ = ["main", "prepare"]

_WORKER: dict = {}  # in each worker process: its tokenizer and how it reports progress


def _init_worker(tokenizer: str, report) -> None:
    _WORKER["tokenizer"] = load_tokenizer(tokenizer)
    _WORKER["report"] = report if callable(report) else report.put  # a function or a queue


def _write_shard(output: str, index: int, inputs: Sequence[Input], plan: Sequence[Piece],
                 field: str, dtype: str) -> tuple[int, dict]:
    """Tokenize one shard's pieces into its train and validation files."""
    tok, report = _WORKER["tokenizer"], _WORKER["report"]
    writers = {s: ShardWriter(output, s, index, dtype) for s in SPLITS}
    docs = tokens = 0
    last = time.monotonic()
    for piece in plan:
        for name, text in read_piece(inputs[piece.input], piece, field):
            ids = tok.encode(text)
            writers["validation" if is_validation(name) else "train"].add(ids)
            docs, tokens = docs + 1, tokens + len(ids)
            if time.monotonic() - last > 0.25:
                report((docs, tokens, 0))
                docs = tokens = 0
                last = time.monotonic()
        report((docs, tokens, piece.size))
        docs = tokens = 0
    return index, {s: w.finish() for s, w in writers.items()}


class _Progress:
    """Documents, tokens, MB/s and time left on stderr: tqdm's bar where tqdm is
    installed, else one line rewritten in place."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.docs = self.tokens = self.bytes = 0
        self.total, self.enabled = total_bytes, enabled
        self.start = self._shown = time.monotonic()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True,
                                 desc="prepare", file=sys.stderr, leave=True)
            except ImportError:
                pass

    def update(self, counts: tuple[int, int, int]) -> None:
        docs, tokens, nbytes = counts
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, \
            self.bytes + nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.docs:,} documents, {self.tokens:,} tokens",
                                      refresh=False)
            self._bar.update(nbytes)
        elif self.enabled and time.monotonic() - self._shown > 0.5:
            self._shown = time.monotonic()
            rate = self.bytes / max(self._shown - self.start, 1e-9)
            left = (self.total - self.bytes) / rate if rate else float("nan")
            sys.stderr.write(f"\rprepare: {self.docs:,} documents, {self.tokens:,} tokens, "
                             f"{rate / 2**20:.1f} MB/s, {left:.0f} s left   ")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _request(inputs: Sequence[Input], tok, field: str, shard_mb: float) -> dict:
    return {"format_version": FORMAT_VERSION, "tokenizer": tok.name,
            "tokenizer_fingerprint": tok.fingerprint, "field": field, "shard_mb": shard_mb,
            "inputs": [[i.name, i.kind, i.size, i.path] for i in inputs]}


def _differences(old: dict, new: dict) -> list[str]:
    """What makes `new` another cache than `old`: inputs are compared by their relative
    names, kinds and sizes (not where they lie)."""
    out = []
    if old.get("tokenizer_fingerprint") != new["tokenizer_fingerprint"]:
        out.append(f"it was made with tokenizer {old.get('tokenizer')!r} (fingerprint "
                   f"{str(old.get('tokenizer_fingerprint'))[:12]}), not {new['tokenizer']!r} "
                   f"({new['tokenizer_fingerprint'][:12]})")
    for key in ("format_version", "field", "shard_mb"):
        if old.get(key) != new[key]:
            out.append(f"its {key} is {old.get(key)!r}, not {new[key]!r}")
    was = [tuple(i[:3]) for i in old.get("inputs", [])]
    now = [tuple(i[:3]) for i in new["inputs"]]
    if was != now:
        first = next((k for k, (a, b) in enumerate(zip(was, now)) if a != b), min(len(was),
                                                                                  len(now)))
        show = lambda x: f"{x[0]} ({x[1]}, {x[2]} bytes)" if x else "nothing"  # noqa: E731
        out.append(f"its inputs differ ({len(was)} there, {len(now)} now; input {first + 1}: "
                   f"{show(was[first] if first < len(was) else None)} there, "
                   f"{show(now[first] if first < len(now) else None)} now)")
    return out


def _group(plan: Sequence[Piece], target: int) -> list[list[Piece]]:
    """Consecutive pieces into shards of at least `target` bytes (the last may be less)."""
    shards, size = [[]], 0
    for p in plan:
        if shards[-1] and size >= target:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.size
    return shards


def prepare(inputs: Sequence[str], output: str, tokenizer: str = "byte", field: str = "text",
            workers: int | None = None, shard_mb: float = 64.0,
            progress: bool | None = None) -> dict:
    """Prepare (or resume, or leave as it is) the token cache `output`; its metadata."""
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as e:  # its errors name the config field; here it is the flag
        raise ValueError(str(e).replace("data.tokenizer:", "--tokenizer:", 1)) from None
    storage.check_reachable(output, "--output")  # a bucket: before any tokenizing
    found = find_inputs(inputs)
    out = storage.path(output)
    request = _request(found, tok, field, shard_mb)
    meta_path, request_path = out / "metadata.json", out / "prepare.json"
    old = json.loads(request_path.read_text()) if request_path.exists() else None
    if old is not None:
        if diffs := _differences(old, request):
            raise ValueError(f"--output {output} holds the token cache of other inputs: "
                             f"{'; '.join(diffs)}; give another --output, or delete {output} "
                             "to prepare it anew")
        if meta_path.exists():
            print(f"{output}: already prepared from these inputs with this tokenizer; nothing "
                  "to do", file=sys.stderr)
            return json.loads(meta_path.read_text())
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"--output {output}: a directory that is not empty and not a token "
                         "cache; give a new or empty directory")
    if shard_mb <= 0:
        raise ValueError(f"--shard_mb {shard_mb}: must be positive (about 64 is usual)")
    target = max(1, int(shard_mb * 2**20))
    shards = _group(pieces(found, target, field), target)
    plan_sha = hashlib.sha256(json.dumps(
        [[dataclasses.astuple(p) for p in s] for s in shards]).encode()).hexdigest()
    if old is not None and old.get("plan_sha256") != plan_sha:
        raise ValueError(f"--output {output}: the inputs' contents changed since this cache was "
                         f"started (the shard plan differs); delete {output} to prepare it anew")
    out.mkdir(parents=True, exist_ok=True)
    write_json(request_path, {**request, "plan_sha256": plan_sha})

    done = {}
    for i in range(len(shards)):
        entries = {s: finished_shard(out, s, i) for s in SPLITS}
        if all(entries.values()):
            done[i] = entries
    if done:
        print(f"{output}: resuming; {len(done)} of {len(shards)} shards are finished and "
              "verify", file=sys.stderr)
    todo = [i for i in range(len(shards)) if i not in done]
    dtype = ids_dtype(tok.vocab_size).str
    bar = _Progress(sum(p.size for i in todo for p in shards[i]),
                    sys.stderr.isatty() if progress is None else progress)
    n = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    try:
        if n == 1:  # in this process: no worker start-up
            _init_worker(tokenizer, bar.update)
            done.update(_write_shard(output, i, found, shards[i], field, dtype) for i in todo)
        else:
            done.update(_run_pool(n, tokenizer, bar, [(output, i, found, shards[i], field, dtype)
                                                      for i in todo]))
    finally:
        bar.close()

    splits = {s: {"num_documents": sum(done[i][s]["num_documents"] for i in done),
                  "num_tokens": sum(done[i][s]["num_tokens"] for i in done),
                  "shards": [done[i][s] for i in range(len(shards))]} for s in SPLITS}
    meta = {**{k: v for k, v in request.items() if k != "inputs"},
            "inputs": [i[:3] for i in request["inputs"]], "plan_sha256": plan_sha,
            "bos_id": int(tok.bos_id), "eos_id": int(tok.eos_id),
            "vocab_size": int(tok.vocab_size), "dtype": ids_dtype(tok.vocab_size).name,
            "byte_order": "little", "writer_options": WRITER_OPTIONS,
            "num_documents": sum(s["num_documents"] for s in splits.values()),
            "num_tokens": sum(s["num_tokens"] for s in splits.values()), "splits": splits}
    write_json(meta_path, meta)
    secs = time.monotonic() - bar.start
    print(f"{output}: {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens "
          f"(validation: {splits['validation']['num_documents']:,} documents) in "
          f"{len(shards)} shards; {secs:.1f} s", file=sys.stderr)
    return meta


def _run_pool(n: int, tokenizer: str, bar: _Progress, tasks: list[tuple]) -> dict:
    # spawn: the workers start clean (no copy of a parent's threads); each imports tfjax
    # (and so jax, without starting a device) to reach the tokenizer.
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    done = {}
    pool = cf.ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker,
                                  initargs=(tokenizer, reports))
    try:
        futures = {pool.submit(_write_shard, *t) for t in tasks}
        while futures:
            finished, futures = cf.wait(futures, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            _drain(reports, bar)
            for f in finished:
                i, entries = f.result()
                done[i] = entries
        _drain(reports, bar)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return done


def _drain(reports, bar: _Progress) -> None:
    while True:
        try:
            bar.update(reports.get_nowait())
        except queue_lib.Empty:
            return


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfjax.data.prepare",
                                description="Tokenize inputs once into a token cache.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, globs or directories: .jsonl/.json (.gz, .zst), .parquet, a "
                        "datasets save_to_disk directory, any other file as text")
    p.add_argument("--output", required=True, help="the cache directory")
    p.add_argument("--tokenizer", required=True,
                   help="'byte', a tokenizer file or a checkpoint directory")
    p.add_argument("--field", default="text", help="the record field / column of the text")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.add_argument("--shard_mb", type=float, default=64.0, help="input MB per shard")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="the progress bar (default: when stderr is a terminal)")
    args = p.parse_args(argv)
    try:
        prepare(args.inputs, args.output, args.tokenizer, args.field, args.workers,
                args.shard_mb, args.progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
