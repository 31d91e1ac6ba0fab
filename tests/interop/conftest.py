"""Shared by the interop tests: they need the `hf` extra (torch, transformers) and
run torch on one thread."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


@pytest.fixture(autouse=True, scope="package")
def _torch_on_one_thread(one_torch_thread):
    pass
