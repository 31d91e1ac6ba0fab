"""Passkey retrieval (Mohtashami & Jaggi 2023): a random number hidden at a given depth
of filler text, asked for at the end; accuracy by context length and depth.

    python -m tfjax.eval.passkey (--hf DIR | --workdir W) [--lengths 128,256,512,1024]
        [--depths 0,25,50,75,100 --samples 5 --seed 0 --output P.json --plot P.png]

A sample of `length` tokens is `intro + filler[:a] + needle + filler[a:] + question +
answer`, with `a = round(depth * filler)`; it is right when every answer token (" 71432":
the space and the digits) is the model's greedy prediction given what precedes it, the
exact match greedy decoding would give, from one forward pass (`Scorer`). The grid is
lengths x depths x samples rows, seeded. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from tfjax.eval.loading import (add_eval_flags, check_context, eval_mesh, load_source,
                                simulate_cpu_devices)
from tfjax.eval.perplexity import Scorer
from tfjax.generate import add_checkpoint_flags
from tfjax.train.metrics import ProgressBar

__all__ = ["Sample", "accuracy_table", "build_samples", "format_table", "main", "plot", "run",
           "score"]

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
          "back again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One row: `tokens` (exactly `length` ids), the passkey's digits, where the needle
    sentence starts and where the answer starts (the tokens scored)."""

    tokens: np.ndarray
    passkey: str
    length: int
    depth: float
    needle_start: int
    answer_start: int


def build_samples(encode: Callable[[str, bool], Sequence[int]], lengths: Sequence[int],
                  depths: Sequence[float], samples: int, *, seed: int = 0, digits: int = 5,
                  intro: bool = True) -> list[Sample]:
    """`samples` rows per (length, depth) cell; `encode(text, specials)` is the model's
    tokenizer (BOS with `specials`); depths in [0, 1]; `intro`: the paper's instructions
    first (else the BOS alone). The filler is tiled and cut at token granularity so
    every row has exactly its length; a length too short for the fixed parts is a
    ValueError naming --lengths."""
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if not 1 <= digits <= 18:
        raise ValueError(f"--digits must be in [1, 18], got {digits}")
    if not lengths or not depths:
        raise ValueError("--lengths and --depths must each name at least one value")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"--depths: {bad[0] * 100:g} is not a percentage in [0, 100]")
    head = list(encode(INTRO if intro else "", True))
    question = list(encode(QUESTION, False))
    block = list(encode(FILLER, False))
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        for depth in depths:
            for _ in range(samples):
                key = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
                needle = list(encode(NEEDLE.format(key=key), False))
                answer = list(encode(ANSWER.format(key=key), False))
                n_filler = length - len(head) - len(needle) - len(question) - len(answer)
                if n_filler < 0:
                    fix = "" if not intro else " or leave out the instructions (--no-intro)"
                    raise ValueError(f"--lengths: {length} tokens cannot hold the passkey "
                                     f"prompt ({length - n_filler} tokens without filler); "
                                     f"use lengths >= {length - n_filler}{fix}")
                filler = (block * (n_filler // len(block) + 1))[:n_filler]
                a = round(depth * n_filler)
                tokens = head + filler[:a] + needle + filler[a:] + question + answer
                out.append(Sample(np.asarray(tokens, np.int32), key, length, depth,
                                  needle_start=len(head) + a,
                                  answer_start=length - len(answer)))
    return out


def score(scorer: Scorer, samples: Sequence[Sample], *, multiple: int = 8,
          progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Per sample: is every answer token the greedy prediction (bool `[len(samples)]`).
    Rows of one length go `scorer.batch_size` at a time, right-padded to a multiple of
    `multiple` tokens (the sequence axis must divide them)."""
    right = np.zeros(len(samples), bool)
    B = scorer.batch_size
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault(s.length, []).append(i)
    done = 0
    for length, idx in by_length.items():
        T = -(-(length - 1) // multiple) * multiple
        for b in range(0, len(idx), B):
            chunk = idx[b:b + B]
            tokens = np.zeros((B, T), np.int32)
            targets = np.zeros((B, T), np.int32)
            for r, i in enumerate(chunk):
                t = samples[i].tokens
                tokens[r, :length - 1], targets[r, :length - 1] = t[:-1], t[1:]
            _, greedy = scorer(tokens, targets)
            for r, i in enumerate(chunk):
                right[i] = bool(greedy[r, samples[i].answer_start - 1:length - 1].all())
            done += len(chunk)
            if progress is not None:
                progress(done, len(samples))
    return right


def accuracy_table(samples: Sequence[Sample], right: np.ndarray) -> dict:
    """{"lengths", "depths" (percent), "accuracy" [length][depth], "count" per cell}."""
    lengths = sorted({s.length for s in samples})
    depths = sorted({s.depth for s in samples})
    hits = np.zeros((len(lengths), len(depths)))
    count = np.zeros((len(lengths), len(depths)), int)
    for s, ok in zip(samples, right):
        i, j = lengths.index(s.length), depths.index(s.depth)
        hits[i, j] += ok
        count[i, j] += 1
    return dict(lengths=lengths, depths=[round(d * 100, 6) for d in depths],
                accuracy=(hits / np.maximum(count, 1)).round(6).tolist(),
                count=count.tolist(), mean=float(np.asarray(right).mean()))


def format_table(table: dict) -> str:
    """The table as text: a row per length, a column per depth."""
    head = "length \\ depth " + "".join(f"{d:>8g}%" for d in table["depths"])
    rows = [f"{n:>14d} " + "".join(f"{a:>9.2f}" for a in accs)
            for n, accs in zip(table["lengths"], table["accuracy"])]
    return "\n".join([head, *rows, f"mean accuracy {table['mean']:.3f}"])


def plot(table: dict, path: str, title: str = "passkey retrieval") -> None:
    """A heatmap of the table (matplotlib, the `eval` extra) written to `path` (png)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[eval]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    acc = np.asarray(table["accuracy"])
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * acc.shape[1], 1.0 + 0.6 * acc.shape[0]))
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(acc.shape[1]), [f"{d:g}%" for d in table["depths"]])
    ax.set_yticks(range(acc.shape[0]), [str(n) for n in table["lengths"]])
    ax.set_xlabel("passkey depth")
    ax.set_ylabel("context length (tokens)")
    for (i, j), a in np.ndenumerate(acc):
        ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not comma-separated integers") from None


def run(*, hf: str | None = None, workdir: str | None = None, step: int | None = None,
        lengths: str | None = None, depths: str = "0,25,50,75,100", samples: int = 5,
        seed: int = 0, digits: int = 5, intro: bool = True, batch_size: int = 8,
        mesh: str | None = None, output: str | None = None, plot_path: str | None = None,
        progress: bool = True) -> dict:
    """The CLI as a function: the result dict (also written to `output` as JSON).
    `lengths` default: the model's context / 8, / 4, / 2 and the context."""
    for flag, path in (("--output", output), ("--plot", plot_path)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag}: the directory of {path} does not exist; create it first")
    for flag, path in (("--hf", hf), ("--workdir", workdir)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag}: {path} not found")
    depth_list = [d / 100 for d in _ints(depths, "--depths")]
    length_list = _ints(lengths, "--lengths") if lengths else None
    src = load_source(hf=hf, workdir=workdir, step=step)
    if length_list is None:
        length_list = sorted({max(1, src.context // k) for k in (8, 4, 2, 1)})
    for n in length_list:
        check_context(src, n, "--lengths")
    rows = build_samples(src.encode, length_list, depth_list, samples, seed=seed, digits=digits,
                         intro=intro)
    device_mesh, mesh_cfg = eval_mesh(mesh, src.rules)
    scorer = Scorer(src.model, mesh=device_mesh, rules=mesh_cfg.rules, batch_size=batch_size)
    seq = device_mesh.shape.get("sequence", 1)
    print(f"[tfjax.eval.passkey: {src.description}, {len(rows)} rows = {len(length_list)} "
          f"lengths x {len(depth_list)} depths x {samples}, batch {scorer.batch_size} on "
          f"{device_mesh.size} devices]", file=sys.stderr, flush=True)
    bar = ProgressBar(len(rows), enabled=progress)
    start = time.perf_counter()
    right = score(scorer, rows, multiple=8 * seq,
                  progress=lambda done, total: bar.update(done, "passkey rows"))
    bar.close()
    result = accuracy_table(rows, right)
    result.update(samples=samples, seed=seed, digits=digits, intro=intro, model=src.description,
                  seconds=round(time.perf_counter() - start, 3))
    if src.step is not None:
        result["step"] = src.step
    print(format_table(result), flush=True)
    if output is not None:
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path is not None:
        plot(result, plot_path, f"passkey retrieval: {src.description}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfjax.eval.passkey",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p)
    add_eval_flags(p, "rows")
    p.add_argument("--lengths", default=None, help="context lengths in tokens, e.g. "
                   "128,256,512,1024 (default: the model's context / 8, / 4, / 2, x 1)")
    p.add_argument("--depths", default="0,25,50,75,100", help="passkey depths in percent")
    p.add_argument("--samples", type=int, default=5, help="rows per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys")
    p.add_argument("--digits", type=int, default=5, help="digits of a passkey")
    p.add_argument("--intro", action=argparse.BooleanOptionalAction, default=True,
                   help="begin with the paper's instructions (--no-intro: filler from the "
                   "first token, for short contexts)")
    p.add_argument("--output", default=None, help="write the table here as JSON")
    p.add_argument("--plot", default=None, help="write a heatmap here (png; matplotlib)")
    a = p.parse_args(argv)
    simulate_cpu_devices(a.cpu_devices)
    try:
        run(hf=a.hf, workdir=a.workdir, step=a.step, lengths=a.lengths, depths=a.depths,
            samples=a.samples, seed=a.seed, digits=a.digits, intro=a.intro,
            batch_size=a.batch_size, mesh=a.mesh, output=a.output, plot_path=a.plot,
            progress=a.progress)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
