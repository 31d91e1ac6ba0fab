"""Shared by the interop tests: they need the `hf` extra (torch, transformers) and
run torch on one thread."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    # Idle intra-op threads spin: many CPU-seconds for these tiny models.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
