"""The --quick modes of the synthetic-task experiments run and write their report.

The scripts run in subprocesses (`main(["--quick", "--out", <tmp>])`): quick mode
turns XLA optimisations off (`jax_disable_most_optimizations`) to compile in seconds,
a global jax setting that must not leak into the test process. Two subprocesses of
two scripts each start together so their compilations overlap: synthetic_tasks and
lost_in_middle share one (their quick dense-attention and Mamba models are the same
config, so `synthetic_tasks.trainer` compiles them once), window_receptive_field and
moe the other; each pays one jax start-up for two scripts. The test then checks each
markdown report holds a filled table and that a plot was written."""

import os
import re
import subprocess
import sys

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments")
GROUPS = (("synthetic_tasks", "lost_in_middle"), ("window_receptive_field", "moe"))
NAMES = tuple(name for group in GROUPS for name in group)

# One subprocess: each script's main(argv) in turn, as `python experiments/<name>.py`
# would run it (the experiments directory first on sys.path), stopping at the first
# failure; a line per script marks where its output starts.
RUN = """import importlib, sys
sys.path.insert(0, sys.argv[1])
out = sys.argv[2]
for name in sys.argv[3:]:
    print(f"=== {name} --quick", flush=True)
    importlib.import_module(name).main(["--quick", "--out", f"{out}/{name}"])
"""


def test_quick_modes_write_their_tables(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [(group, subprocess.Popen(
        [sys.executable, "-c", RUN, EXPERIMENTS, str(tmp_path), *group],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
        for group in GROUPS]
    logs = {}
    for group, p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{' + '.join(group)} --quick failed:\n{log[-4000:]}"
        for name in group:
            logs[name] = log.split(f"=== {name} --quick")[1]
    assert sorted(logs) == sorted(NAMES)
    for name, log in logs.items():
        out = tmp_path / name
        md = out / f"{name}_quick.md"
        assert md.exists(), f"{name} --quick wrote no {md.name}:\n{log[-2000:]}"
        text = md.read_text()
        assert "--quick" in text.splitlines()[2]  # the command line is recorded
        rows = [line for line in text.splitlines() if line.startswith("| ")]
        assert len(rows) >= 3, f"{name}: no table in\n{text}"
        assert any(re.search(r"\|\s*-?\d[\d,.]*(e[+-]?\d+)?\s*\|", r) for r in rows[2:]), text
        assert (out / f"{name}_quick.png").exists(), f"{name} wrote no plot"
