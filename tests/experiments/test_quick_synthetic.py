"""The --quick modes of the synthetic-task experiments run and write their report.

Each script runs in its own subprocess (`--quick --out <tmp>`): quick mode turns
XLA optimisations off (`jax_disable_most_optimizations`) to compile in seconds, a
global jax setting that must not leak into the test process. The four start
together so their compilations overlap; the test then checks each markdown report
holds a filled table and that a plot was written."""

import os
import re
import subprocess
import sys

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
NAMES = ("synthetic_tasks", "window_receptive_field", "lost_in_middle", "moe")


def test_quick_modes_write_their_tables(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {}
    for name in NAMES:
        out = tmp_path / name
        procs[name] = (out, subprocess.Popen(
            [sys.executable, os.path.join(EXPERIMENTS, name + ".py"), "--quick", "--out",
             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    for name, (out, p) in procs.items():
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{name} --quick failed:\n{log[-4000:]}"
        md = out / f"{name}_quick.md"
        assert md.exists(), f"{name} --quick wrote no {md.name}:\n{log[-2000:]}"
        text = md.read_text()
        assert "--quick" in text.splitlines()[2]  # the command line is recorded
        rows = [line for line in text.splitlines() if line.startswith("| ")]
        assert len(rows) >= 3, f"{name}: no table in\n{text}"
        assert any(re.search(r"\|\s*-?\d[\d,.]*(e[+-]?\d+)?\s*\|", r) for r in rows[2:]), text
        assert (out / f"{name}_quick.png").exists(), f"{name} wrote no plot"
