"""`python -m tfjax.train` end to end with the real model (tfjax.models.build): a short
run, a rerun that resumes, two processes with gloo collectives, and AOT compilation
for a TPU slice."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_layers=2",
        "--config.train.batch_size=4", "--config.train.seq_len=32", "--config.train.log_every=1",
        "--config.train.eval_batches=1", "--config.train.warmup_steps=1"]


def cli(*args, devices=1, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen([sys.executable, "-m", "tfjax.train", "--config",
                             os.path.join(ROOT, "configs/default.py"), f"--cpu_devices={devices}",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_cli_trains_evaluates_samples_and_resumes(tmp_path):
    wd = str(tmp_path / "w")
    p = cli("--workdir", wd, "--config.train.steps=3", "--config.train.sample_tokens=8", *TINY)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert "val_bpb" in out and "gzip -9" in out and "sample (greedy)" in out
    assert sorted(losses(wd)) == [1, 2, 3]
    assert os.path.isdir(os.path.join(wd, "checkpoints", "3"))
    # same command again: resumes at step 3, nothing left to train
    p = cli("--workdir", wd, "--config.train.steps=3", "--config.train.sample_tokens=0", *TINY)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and "resumed from step 3" in out, out


def test_cli_config_errors_are_clear(tmp_path):
    p = cli("--workdir", str(tmp_path), "--config.train.batch_size=3", "--config.mesh.data=2",
            devices=2)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 2
    assert "train.batch_size: 3 is not divisible by the 2 batch shards" in out


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = ["--config.train.steps=3", "--config.train.sample_tokens=0", "--config.mesh.data=4",
            "--config.checkpoint.enabled=False", *TINY]
    one = cli("--workdir", str(tmp_path / "one"), *args, devices=4)
    procs = [cli("--workdir", str(tmp_path / "two"), *args, devices=2,
                 *[f"--coordinator_address=localhost:{port}", "--num_processes=2",
                   f"--process_id={i}"]) for i in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in [one, *procs]]
    assert all(p.returncode == 0 for p in [one, *procs]), "\n".join(outs)
    a, b = losses(str(tmp_path / "one")), losses(str(tmp_path / "two"))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-5)


@pytest.mark.slow
def test_compile_only_for_a_tpu_slice(tmp_path):
    pytest.importorskip("libtpu")
    p = subprocess.run([sys.executable, "-m", "tfjax.train", "--config",
                        os.path.join(ROOT, "configs/default.py"), "--compile_only",
                        "--topology", "v5e:2x2", "--config.mesh.data=2", "--config.mesh.fsdp=2",
                        *TINY], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                            "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "compiled train step for v5e:2x2" in p.stdout and "FITS" in p.stdout
