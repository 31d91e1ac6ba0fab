"""`python -m tfjax.eval (--hf DIR | --workdir W) --data FILE.jsonl [--output OUT.json]
[--batch_size B --context T --stride S --mesh data=2,tensor=2 --step STEP]`

Perplexity of a causal LM on a jsonl file, data-parallel over the available devices:
prints and writes (`--output`) the number of scored tokens, the mean negative
log-likelihood per token (nats), the perplexity and, when every line is text, bits
per byte. Each line holds "text" (tokenised with the checkpoint's tokenizer) or
"input_ids" (scored as given); a sequence longer than the model's context is scored in
windows (`--stride`). Bad input is one line (exit status 2) before anything compiles.

See docs/evaluation.md; the lm-eval-harness backend is `tfjax.eval.harness`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from tfjax.eval.loading import (Source, add_eval_flags, check_context, eval_mesh, load_source,
                                simulate_cpu_devices)
from tfjax.eval.perplexity import Scorer, evaluate, summarize
from tfjax.generate import add_checkpoint_flags
from tfjax.train.metrics import ProgressBar

__all__ = ["main", "read_jsonl", "run"]


def _check_data(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"--data: {path} not found; give a .jsonl file with one "
                         f'{{"text": ...}} or {{"input_ids": [...]}} object per line')


def read_jsonl(path: str, src: Source) -> tuple[list[np.ndarray], int | None]:
    """(token id arrays, UTF-8 bytes of the texts or None when a line gives input_ids)."""
    _check_data(path)
    sequences, num_bytes = [], 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--data {path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}); each line must be one JSON "
                                 f"object") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                ids = np.asarray(src.encode(row["text"], True), np.int64)
                if num_bytes is not None:
                    num_bytes += len(row["text"].encode("utf-8"))
            elif isinstance(row, dict) and isinstance(row.get("input_ids"), list):
                ids = row["input_ids"]
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise ValueError(f"{where}: input_ids must be a list of integers")
                ids, num_bytes = np.asarray(ids, np.int64), None
            else:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f'{where}: needs "text" (a string) or "input_ids" (a list '
                                 f"of ints); got {keys}")
            bad = ids[(ids < 0) | (ids >= src.vocab_size)]
            if bad.size:
                raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's "
                                 f"vocabulary [0, {src.vocab_size}); ids must come from this "
                                 f"model's tokenizer")
            sequences.append(ids.astype(np.int32))
    if not sequences:
        raise ValueError(f"--data: {path} has no lines to score")
    return sequences, num_bytes


def run(*, data: str, hf: str | None = None, workdir: str | None = None,
        output: str | None = None, step: int | None = None, batch_size: int = 8,
        context: int | None = None, stride: int | None = None, mesh: str | None = None,
        progress: bool = True) -> dict:
    """The CLI as a function: the result dict (also written to `output` as JSON)."""
    if output is not None and not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise ValueError(f"--output: the directory of {output} does not exist; create it first")
    for flag, path in (("--hf", hf), ("--workdir", workdir)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag}: {path} not found")
    _check_data(data)
    src = load_source(hf=hf, workdir=workdir, step=step)
    ctx = check_context(src, src.context if context is None else context)
    if stride is not None and not 1 <= stride <= ctx:
        raise ValueError(f"--stride must be in [1, context={ctx}], got {stride}")
    sequences, num_bytes = read_jsonl(data, src)
    device_mesh, mesh_cfg = eval_mesh(mesh, src.rules)
    scorer = Scorer(src.model, mesh=device_mesh, rules=mesh_cfg.rules, batch_size=batch_size)
    print(f"[tfjax.eval: {src.description}, {len(sequences)} sequences, context {ctx}, "
          f"batch {scorer.batch_size} on {device_mesh.size} devices]", file=sys.stderr,
          flush=True)
    bar = ProgressBar(1, enabled=progress)

    def show(done, total, nll):
        bar.total = total
        bar.update(done, f"windows nll {nll:.4f}")

    got = evaluate(scorer, sequences, context=ctx, stride=stride, progress=show)
    bar.close()
    result = summarize(got["nll_sum"], got["tokens"], num_bytes)
    result.update(sequences=len(sequences), windows=got["windows"], context=ctx,
                  stride=stride or ctx, model=src.description, data=data)
    if src.step is not None:
        result["step"] = src.step
    line = (f"tokens {result['tokens']:,}  nll {result['nll']:.6f}  "
            f"perplexity {result['perplexity']:.4f}")
    if "bits_per_byte" in result:
        line += f"  bits_per_byte {result['bits_per_byte']:.6f} ({result['bytes']:,} bytes)"
    print(line, flush=True)
    if output is not None:
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfjax.eval",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p)
    p.add_argument("--data", required=True, help='jsonl: {"text": ...} or {"input_ids": [...]}')
    p.add_argument("--output", default=None, help="write the numbers here as JSON")
    add_eval_flags(p, "windows")
    p.add_argument("--context", type=int, default=None, help="window length in tokens "
                   "(default: the model's context)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts "
                   "(default: the context, disjoint windows)")
    a = p.parse_args(argv)
    simulate_cpu_devices(a.cpu_devices)
    try:
        run(data=a.data, hf=a.hf, workdir=a.workdir, output=a.output, step=a.step,
            batch_size=a.batch_size, context=a.context, stride=a.stride, mesh=a.mesh,
            progress=a.progress)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
