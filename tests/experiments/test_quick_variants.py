"""experiments/attention_variants.py and mtp_speculative.py --quick run and write their tables."""

import importlib.util
import os
import sys

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")


def test_attention_variants_quick(tmp_path):
    if EXPERIMENTS not in sys.path:
        sys.path.insert(0, EXPERIMENTS)
    spec = importlib.util.spec_from_file_location(
        "experiments_attention_variants", os.path.join(EXPERIMENTS, "attention_variants.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    per_seed = module.main(["--quick", "--out", str(tmp_path)])
    assert set(per_seed) == set(module.VARIANTS)
    text = (tmp_path / "attention_variants_quick.md").read_text()
    assert "--quick" in text.splitlines()[2]
    assert sum(line.startswith("| ") for line in text.splitlines()) == 1 + len(module.VARIANTS)  # header + rows
    assert (tmp_path / "attention_variants_quick.png").exists()


def test_mtp_speculative_quick(tmp_path):
    if EXPERIMENTS not in sys.path:
        sys.path.insert(0, EXPERIMENTS)
    spec = importlib.util.spec_from_file_location(
        "experiments_mtp_speculative", os.path.join(EXPERIMENTS, "mtp_speculative.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--quick", "--out", str(tmp_path)])
    assert set(results) == set(module.DEPTHS)
    text = (tmp_path / "mtp_speculative_quick.md").read_text()
    assert sum(line.startswith("| ") for line in text.splitlines()) == 1 + len(module.DEPTHS)
    assert "NO" not in text  # speculative decoding equals greedy at every depth
