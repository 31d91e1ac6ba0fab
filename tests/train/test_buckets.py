"""A run on a bucket, end to end, against a local GCS emulator (tests/gcs_emulator.py):
`tfjax.data.prepare` writes a token cache to gs://, the trainer reads it with
`--workdir gs://...` (metrics, config, orbax checkpoints, the compilation cache), is
stopped by SIGTERM and resumed, and its losses equal those of an uninterrupted run with
a local workdir; an unreachable bucket is one line before anything compiles."""

import json
import os
import signal
import sys
import time

import numpy as np
import pytest

from test_cli import ROOT, TINY, cli, finish
from tfjax import storage

sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
from token_caches import prepared_cache  # noqa: E402


def _losses(text: str) -> dict[int, float]:
    recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.slow
def test_prepare_train_kill_and_resume_on_a_bucket(gcs_bucket, tmp_path):
    rng = np.random.default_rng(0)
    docs = lambda n: [list(rng.integers(97, 123, rng.integers(5, 80))) for _ in range(n)]
    cache = prepared_cache(f"{gcs_bucket}/caches/web", dict(train=docs(40), validation=docs(2)),
                           src=tmp_path / "web.src")
    # the shards went up through the file layer; nothing local under the cache's name
    assert storage.path(f"{cache}/metadata.json").exists()
    assert list(storage.path(f"{cache}/train").glob("*.arrayrecord"))
    args = ["--config.train.steps=4", "--config.train.sample_tokens=0",
            "--config.train.eval_at_end=False", "--config.checkpoint.every_steps=2",
            "--config.data.source=cache", f"--config.data.paths=('{cache}',)", *TINY]
    ref = cli("--workdir", str(tmp_path / "ref"), *args, "--config.checkpoint.enabled=False")
    (out,) = finish([ref], 300, "a run with a local workdir")
    assert ref.returncode == 0, out
    want = _losses((tmp_path / "ref" / "metrics.jsonl").read_text())
    assert sorted(want) == [1, 2, 3, 4]

    workdir = f"{gcs_bucket}/runs/one"
    run = cli("--workdir", workdir, *args)
    deadline = time.monotonic() + 300
    while not storage.path(f"{workdir}/config.json").exists():  # in train(), compiling
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()[0]
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    (out,) = finish([run], 300, "the run on a bucket, after SIGTERM")
    assert run.returncode == 143 and "SIGTERM: saved step" in out, out
    again = cli("--workdir", workdir, *args)
    (out,) = finish([again], 300, "the resumed run on a bucket")
    assert again.returncode == 0 and "resumed from step" in out, out
    got = _losses(storage.path(f"{workdir}/metrics.jsonl").read_text())
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[k] for k in want] == [want[k] for k in want]  # bit for bit
    steps = {p.name for p in storage.path(f"{workdir}/checkpoints").iterdir()}
    assert {"2", "4"} <= steps, steps
    assert list(storage.path(f"{workdir}/compilation_cache").iterdir())
    assert json.loads(storage.path(f"{workdir}/config.json").read_text())["data"]["paths"] \
        == [cache]


@pytest.mark.bad_input
def test_a_bucket_that_does_not_exist_is_one_line_before_compiling(gcs_bucket, tmp_path):
    run = cli("--workdir", "gs://no-such-bucket-tfjax/run", "--config.train.steps=1", *TINY)
    (out,) = finish([run], 120, "a run on a missing bucket")
    assert run.returncode != 0
    assert ("--workdir: gs://no-such-bucket-tfjax/run: bucket gs://no-such-bucket-tfjax does "
            "not exist; create it") in out, out
    assert "first step" not in out
