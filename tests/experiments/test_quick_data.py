"""experiments/data_pipeline.py --quick runs and writes its five tables (prepare
throughput, loader against the step's need, the trainer's wait for data, a mixture's
shares per block and in the long run), each with measured numbers."""

import importlib.util
import os
import re
import sys

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
TITLES = ("### 1. prepare throughput", "### 2. loader tokens/s", "### 3. the trainer's wait",
          "### 4a. realised share per block", "### 4b. long-run share")


def test_data_pipeline_quick(tmp_path):
    if EXPERIMENTS not in sys.path:
        sys.path.insert(0, EXPERIMENTS)
    spec = importlib.util.spec_from_file_location(
        "experiments_data_pipeline", os.path.join(EXPERIMENTS, "data_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick", "--out", str(tmp_path)])
    text = (tmp_path / "data_pipeline_quick.md").read_text()
    assert "--quick" in text.splitlines()[2]  # the command line is recorded
    sections = re.split(r"(?m)^(?=### )", text)
    for title in TITLES:
        body = next((s for s in sections if s.startswith(title)), None)
        assert body is not None, f"no table {title!r} in\n{text}"
        rows = [line for line in body.splitlines() if line.startswith("| ")][1:]
        assert rows and all(re.search(r"\|\s*\d[\d,.]*(e[+-]?\d+)?\s*\|", r) for r in rows), body
    assert "load average" in text
