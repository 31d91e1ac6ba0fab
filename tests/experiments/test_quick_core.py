"""The --quick modes of the core experiments run and write their report.

Each script's `main(argv)` is called in this process (one jax start-up for all)
with `--quick --out <tmp>`; the test checks the markdown report has a filled table
and that the plot was written."""

import importlib.util
import os
import re
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
NAMES = ("memory_wall", "positions", "components", "gqa", "linear_vs_softmax",
         "sparse_attention", "launch_order", "mla_cache", "recurrent_scaling", "mup")


def _load(name):
    if EXPERIMENTS not in sys.path:
        sys.path.insert(0, EXPERIMENTS)
    spec = importlib.util.spec_from_file_location(f"experiments_{name}",
                                                  os.path.join(EXPERIMENTS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_quick_mode_writes_a_table(name, tmp_path):
    _load(name).main(["--quick", "--out", str(tmp_path)])
    md = tmp_path / f"{name}_quick.md"
    assert md.exists(), f"{name} --quick wrote no {md.name}"
    text = md.read_text()
    assert "--quick" in text.splitlines()[2]  # the command line is recorded
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) >= 3, f"{name}: no table in\n{text}"
    # at least one data row holds a measured number
    assert any(re.search(r"\|\s*-?\d[\d,.]*(e[+-]?\d+)?\s*\|", r) for r in rows[2:]), text
    assert any(p.suffix == ".png" for p in tmp_path.iterdir()), f"{name} wrote no plot"
