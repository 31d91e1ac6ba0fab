"""Which recipe for `make train` (configs/default.py) gets the lowest validation bits
per byte in a fixed CPU budget? A small sweep over steps, batch, sequence length and
learning rate, each run through the real command line and timed.

    python experiments/default_recipe.py [--recipes A,B] [--cpu_devices N]

Every recipe is `python -m tfjax.train --config configs/default.py` with its
settings (the table lists them), a fresh workdir under --workdir, and
`--cpu_devices` passed through (-1: one device per usable core, what `make train`
uses). The table gives the validation bits per byte the trainer prints after its
end-of-run evaluation (the same 147,369 validation bytes for every recipe), beside
xz -9e and gzip -9 on those bytes, the tokens trained on and the wall time of the
whole command (start-up, compilation, training, evaluation and the sample).
Results: experiments/results/default_recipe.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> the recipe's settings (complete, so each row means the same whatever the
# preset's own recipe is); the model is the preset's (0.82M parameters).
_BASE = ["--config.train.seq_len=128", "--config.train.microbatches=1"]
RECIPES = {
    "1x: 16 x 128; lr 3e-3": [*_BASE, "--config.train.steps=1500",
                              "--config.train.batch_size=16", "--config.train.lr=0.003"],
    "A: 2x steps": [*_BASE, "--config.train.steps=3000", "--config.train.batch_size=16",
                    "--config.train.lr=0.003"],
    "B: 2x batch; lr 4e-3": [*_BASE, "--config.train.steps=1500",
                             "--config.train.batch_size=32", "--config.train.lr=0.004"],
    "C: 2x length": ["--config.train.seq_len=256", "--config.train.microbatches=1",
                     "--config.train.steps=1500", "--config.train.batch_size=16",
                     "--config.train.lr=0.003"],
}


def run(name: str, overrides: list[str], workdir: str, cpu_devices: int) -> dict:
    wd = os.path.join(workdir, re.sub(r"\W+", "_", name))
    shutil.rmtree(wd, ignore_errors=True)
    cmd = [sys.executable, "-m", "tfjax.train", "--config", "configs/default.py",
           "--workdir", wd, f"--cpu_devices={cpu_devices}", "--config.train.progress=False",
           *overrides]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    out = p.stdout
    bpb = float(re.search(r"val_bpb ([\d.]+)", out).group(1))
    xz = float(re.search(r"xz -9e ([\d.]+)", out).group(1))
    gz = float(re.search(r"gzip -9 ([\d.]+)", out).group(1))
    batch = re.search(r"global batch (\d+) x (\d+) tokens", out)
    steps = re.findall(r"--config\.train\.steps=(\d+)", " ".join(overrides))
    tokens = int(batch.group(1)) * int(batch.group(2)) * int(steps[-1])
    devices = re.search(r"(\d+) cpu device", out)
    return dict(name=name, overrides=" ".join(o.replace("--config.", "") for o in overrides),
                bpb=bpb, xz=xz, gzip=gz, tokens=tokens, wall=wall,
                devices=devices.group(1) if devices else "?")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names")
    ap.add_argument("--cpu_devices", type=int, default=-1)
    ap.add_argument("--workdir", default="/tmp/default_recipe")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"load average before: {load:.2f}\n")
    print("| recipe | overrides | tokens | CPU devices | val bits/byte | xz -9e | gzip -9 | wall |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in a.recipes.split(","):
        r = run(name, RECIPES[name], a.workdir, a.cpu_devices)
        m, s = divmod(round(r["wall"]), 60)
        print(f"| {r['name']} | {r['overrides'] or '(none)'} | {r['tokens'] / 1e6:.2f}M | "
              f"{r['devices']} | {r['bpb']:.3f} | {r['xz']:.3f} | {r['gzip']:.3f} | {m}m{s:02d}s |",
              flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
