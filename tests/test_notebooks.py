"""The colab/ notebooks run top to bottom, and each .ipynb is in sync with its
jupytext source (`colab/NN_name.py`, the file to edit; `jupytext --sync` pairs them).

Each notebook runs in a fresh kernel (the "python3" kernelspec, which jupyter_client
resolves to this interpreter: the venv's python, checked below) with the repository
root as working directory. The kernel does not inherit this suite's 8 simulated
devices: notebook 04 asks for its own before importing jax.
"""

import json
import os
import pathlib
import re
import sys

import pytest

nbclient = pytest.importorskip(
    "nbclient", reason="the colab/ notebook tests need the `notebooks` extra: "
                       "pip install -e '.[notebooks]' (nbclient, jupytext, ipykernel)")
jupytext = pytest.importorskip("jupytext", reason="needs jupytext (the `notebooks` extra)")
nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the `notebooks` extra)")
pytest.importorskip("ipykernel", reason="needs ipykernel (the `notebooks` extra)")

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NAMES = sorted(p.stem for p in COLAB.glob("[0-9][0-9]_*.py"))
EXPECTED = ["01_tour", "02_attention_patterns", "03_train_tiny_lm", "04_ring_attention",
            "05_kv_cache_generation", "06_finetune_lora", "07_induction_heads",
            "08_vision_language"]
PROBE = "import sys, json; print('KERNEL' + json.dumps([sys.executable, sys.prefix]))"


def test_every_notebook_is_here_and_paired():
    assert NAMES == EXPECTED
    for name in NAMES:
        assert (COLAB / f"{name}.ipynb").exists(), f"run: jupytext --to ipynb colab/{name}.py"


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("name", NAMES)
def test_ipynb_in_sync_with_py(name):
    py = jupytext.read(COLAB / f"{name}.py")
    ipynb = jupytext.read(COLAB / f"{name}.ipynb")
    assert _cells(py) == _cells(ipynb), (
        f"colab/{name}.ipynb differs from colab/{name}.py; regenerate it with "
        f".venv/bin/jupytext --to ipynb colab/{name}.py")
    raw = json.loads((COLAB / f"{name}.ipynb").read_text())
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert not cell["outputs"] and cell["execution_count"] is None, \
                f"colab/{name}.ipynb has outputs: commit it stripped (jupytext --to ipynb)"
    assert "google.colab" in _cells(py)[1][1] + _cells(py)[2][1], "an install cell for Colab"


def _kernel_env():
    env = dict(os.environ)
    # conftest gave this process 8 simulated devices; notebooks choose their own.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    # The notebooks' own checks (ring == reference, cached == recomputed decoding, ...)
    # compare programs compiled alike; without most XLA optimisation passes (what
    # experiments/ --quick and the CLI tests use) they compile in about half the time.
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=_kernel_env())  # raises CellExecutionError naming the failing cell
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    executable, prefix = json.loads(out.split("KERNEL", 1)[1])
    assert os.path.realpath(prefix) == os.path.realpath(sys.prefix), (
        f"the notebook kernel ran {executable}, not this environment's {sys.executable}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
