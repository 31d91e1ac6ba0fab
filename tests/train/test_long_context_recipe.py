"""The long-context recipe of docs/long_context.md end to end at toy size, through the
command lines a user runs: train `configs/default.py:tiny` briefly at 32 tokens a row,
continue it with `configs/long_context_extend.py:tiny` at 8x (256 tokens, llama3
RoPE scaling, ring attention over 2 simulated devices), then the passkey evaluation
on a sequence-parallel mesh. The accuracy of so short a run is whatever it is; the
test checks the plumbing, not a number."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's 8 devices
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_extend_a_tiny_run_8x_then_passkey(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    quiet = ["--config.train.sample_tokens=0", "--config.train.eval_batches=0",
             "--config.train.eval_at_end=False", "--config.train.progress=False"]
    _run("tfjax.train", "--config", "configs/default.py:tiny", "--workdir", str(short),
         "--config.train.steps=3", "--config.train.batch_size=4",
         "--config.train.microbatches=1", "--config.train.seq_len=32", *quiet)
    got = _run("tfjax.train", "--config", "configs/long_context_extend.py:tiny", "--workdir",
               str(long), f"--config.init_from={short}", "--config.train.steps=2",
               "--config.train.batch_size=2", "--config.train.seq_len=256",
               "--config.model.rope.original_max_len=32", "--config.mesh.sequence=2",
               "--cpu_devices=2", *quiet)
    assert "init_from" in got.stdout + got.stderr
    saved = json.loads((long / "config.json").read_text())
    assert saved["context_extension"] is True
    assert saved["model"]["rope"] | dict(scaling="llama3", factor=8.0, original_max_len=32) \
        == saved["model"]["rope"]
    assert saved["model"]["d_model"] == 64 and saved["model"]["num_layers"] == 2  # default:tiny
    table, png = tmp_path / "passkey.json", tmp_path / "passkey.png"
    out = _run("tfjax.eval.passkey", "--workdir", str(long), "--cpu_devices", "2", "--mesh",
               "sequence=2", "--lengths", "112,256", "--depths", "0,50,100", "--samples", "2",
               "--no-intro", "--output", str(table), "--plot", str(png), "--no-progress")
    result = json.loads(table.read_text())
    assert result["lengths"] == [112, 256] and result["depths"] == [0.0, 50.0, 100.0]
    assert result["count"] == [[2, 2, 2], [2, 2, 2]] and result["step"] == 2
    assert all(0.0 <= a <= 1.0 for row in result["accuracy"] for a in row)
    assert "length \\ depth" in out.stdout and png.stat().st_size > 1000
