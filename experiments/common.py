"""Shared plumbing for the scripts in experiments/: arguments, results, tables, plots.

Every experiment is a script with a ``--quick`` mode (seconds, run by the test
suite) and a full mode (minutes, whose results are quoted in
experiments/README.md). Each writes ``experiments/results/<name>[_quick].md`` (a
markdown table plus the command and the machine) and, where it has a curve,
``experiments/results/<name>[_quick].png``.

    from common import Experiment
    exp = Experiment("memory_wall", __doc__)       # parses --quick, --out
    ...
    exp.table(["length", "bytes"], rows, title="Attention matrix")
    exp.plot({"reference": (xs, ys)}, xlabel="T", ylabel="MiB", logx=True)
    exp.finish()
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def preset_config(name: str, variant: str | None = None):
    """`configs/<name>.py`'s `get_config(variant)`: a preset's ConfigDict, as
    `--config configs/<name>.py[:variant]` gives it to `python -m tfjax.train`."""
    path = os.path.join(HERE, "..", "configs", name + ".py")
    spec = importlib.util.spec_from_file_location("preset_" + name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def fmt(x: Any) -> str:
    """A cell: ints with thousands separators, floats with 4 significant digits."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:  # nan
            return "nan"
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:.4g}"
        return f"{x:.3e}"
    return str(x)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Experiment:
    """Arguments, a markdown report and an optional plot for one experiment."""

    def __init__(self, name: str, doc: str | None = None,
                 parser: argparse.ArgumentParser | None = None, argv=None):
        self.name = name
        p = parser or argparse.ArgumentParser(
            description=(doc or name).strip().splitlines()[0])
        p.add_argument("--quick", action="store_true",
                       help="tiny sizes, seconds on a CPU (what the test suite runs)")
        p.add_argument("--out", default=RESULTS, help="directory for the .md and .png")
        self.args = p.parse_args(argv)
        self.quick = self.args.quick
        self.stem = name + ("_quick" if self.quick else "")
        self.sections: list[str] = []
        # Called as main(argv) (from a test), sys.argv[0] is not the script: name it.
        script = os.path.basename(sys.argv[0]) if argv is None else name + ".py"
        self.command = "python experiments/" + script + (
            " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()

    def text(self, s: str) -> None:
        self.sections.append(s.strip())
        print(s.strip(), flush=True)

    def table(self, header, rows, title: str | None = None) -> str:
        t = markdown_table(header, rows)
        self.sections.append((f"### {title}\n\n" if title else "") + t)
        print(("\n" + title + "\n" if title else "\n") + t, flush=True)
        return t

    def plot(self, curves: dict, *, xlabel: str, ylabel: str, title: str | None = None,
             logx: bool = False, logy: bool = False, suffix: str = "") -> str | None:
        """curves: label -> (xs, ys), or (xs, ys, lo, hi) to shade a band between lo and
        hi (e.g. the spread over seeds). Writes <stem><suffix>.png; None without
        matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot", flush=True)
            return None
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, (xs, ys, *band) in curves.items():
            line, = ax.plot(xs, ys, marker="o", label=label)
            if band:
                ax.fill_between(xs, band[0], band[1], color=line.get_color(), alpha=0.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title or self.name)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        os.makedirs(self.args.out, exist_ok=True)
        path = os.path.join(self.args.out, self.stem + suffix + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        self.sections.append(f"![{self.name}]({os.path.basename(path)})")
        return path

    def finish(self) -> str:
        import jax
        os.makedirs(self.args.out, exist_ok=True)
        path = os.path.join(self.args.out, self.stem + ".md")
        head = (f"# {self.name}\n\n`{self.command}`  \n"
                f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
                f"jax {jax.__version__}, {jax.devices()[0].platform} "
                f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n")
        with open(path, "w") as f:
            f.write(head + "\n" + "\n\n".join(self.sections) + "\n")
        print(f"wrote {path}", flush=True)
        return path
