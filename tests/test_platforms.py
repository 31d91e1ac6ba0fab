"""`tfjax.platforms`: importing tfjax on a CPU-only machine with libtpu installed
starts jax on the CPU without libtpu's start-up warnings."""

import os
import subprocess
import sys

import pytest

from tfjax.platforms import has_accelerator


@pytest.mark.skipif(has_accelerator(), reason="the machine has an accelerator")
def test_import_on_a_cpu_only_machine_is_quiet():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import tfjax, jax; print(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cpu"
    assert "TPU" not in out.stderr and "libtpu" not in out.stderr, out.stderr
