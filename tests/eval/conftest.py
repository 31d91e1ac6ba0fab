"""Shared by the evaluation tests: a random tiny Hugging Face Llama with a byte-level
tokenizer.json (tfjax's `ByteTokenizer`), saved as `save_pretrained` writes it; a
tfjax training run directory; torch on one thread. They need the `hf` extra (torch,
transformers)."""

from __future__ import annotations

import pathlib

import pytest
from eval_fixtures import save_tiny_llama
from tiny_run import saved_run

pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")


@pytest.fixture(autouse=True, scope="package")
def _torch_on_one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="package")
def hf_dir(tmp_path_factory):
    """(directory, the transformers model) of a random tiny Llama, float32."""
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), save_tiny_llama(str(path))


@pytest.fixture(scope="package")
def run_dir(tmp_path_factory):
    """A tfjax training run directory (checkpoint step 3, byte tokenizer, seq_len 32)."""
    return saved_run(tmp_path_factory.mktemp("run"))[0]


@pytest.fixture(scope="package")
def task_dir(tmp_path_factory):
    """lm-eval task YAMLs (tests/eval/data) with the dataset's absolute path and a
    scratch datasets cache: tfjax_tiny_mc, tfjax_tiny_rolling, tfjax_tiny_gen."""
    data = pathlib.Path(__file__).parent / "data"
    out = tmp_path_factory.mktemp("tasks")
    for name in ("tiny_mc", "tiny_rolling", "tiny_gen"):
        text = (data / f"{name}.yaml").read_text()
        text = text.replace("DATA", str(data / "tiny_tasks.jsonl"))
        (out / f"{name}.yaml").write_text(text.replace("CACHE", str(out / "cache")))
    return str(out)
