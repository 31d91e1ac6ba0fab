"""Tracking and profiling (issue 27 item 6): metrics.jsonl splits the wall time into
step, data wait, checkpoint, eval and compile; `train.wandb` logs the same records to
an offline W&B run that a resumed run continues; `train.profile_steps` writes a
jax.profiler trace."""

import glob
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_decoder
from tiny_setup import devices, preempt_after, tiny_config

from tfjax import config as C
from tfjax.train import Trainer
from tfjax.train.metrics import WallClock

PARTS = ("time_step_s", "time_data_s", "time_checkpoint_s", "time_eval_s", "time_compile_s")


def test_wall_clock_counts_nested_compiles_once_and_keeps_them_out_of_parts():
    def inner(x):
        return jnp.sin(x) * 2

    @jax.jit
    def outer(x):  # traces the inner jit while it is traced itself
        return jax.jit(inner)(x) + jnp.cos(x).sum()

    with WallClock() as clock:
        time.sleep(0.05)  # the rest: step
        with clock.timing("data"):
            time.sleep(0.1)
            outer(jnp.arange(37.0)).block_until_ready()  # compiles inside "data"
        split = clock.split()
        again = clock.split()
    assert split["wall_s"] == pytest.approx(sum(split[k] for k in PARTS), abs=1e-9)
    assert 0.1 <= split["time_data_s"] < 0.1 + 0.5 * split["time_compile_s"]
    assert split["time_compile_s"] > 0.01 and split["time_step_s"] >= 0.05
    # counted once: no more than the wall time it took, nested trace and all
    assert split["time_compile_s"] < split["wall_s"] - 0.14
    assert again["time_compile_s"] == 0.0 and again["wall_s"] < 0.05
    assert clock.totals["wall_s"] == pytest.approx(split["wall_s"] + again["wall_s"])
    outer(jnp.arange(5.0))  # after the clock closed: not heard
    assert clock.totals["time_compile_s"] == split["time_compile_s"]


def test_wall_time_split_wandb_offline_and_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    wd = str(tmp_path / "run")
    cfg = tiny_config(train=dict(steps=4, eval_at_end=True, profile_steps="2,3",
                                 wandb="tfjax-tests", wandb_mode="offline"),
                      mesh=dict(data=1), checkpoint=dict(enabled=True, every_steps=2))
    tr = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(1), log=lambda s: None)
    batches = tr.train_iterator

    class Slow:  # the data pipeline takes 50 ms a batch
        def __init__(self):
            self.it = batches()

        def __next__(self):
            time.sleep(0.05)
            return next(self.it)

        def __getattr__(self, name):
            return getattr(self.it, name)

    tr.train_iterator = Slow
    preempt_after(tr, 3)
    first = tr.train()
    assert first["step"] == 3 and first["preempted"]
    records = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["wall_s"] == pytest.approx(sum(r[k] for k in PARTS), abs=1e-6)
        assert r["time_data_s"] >= 0.05
    assert records[0]["time_compile_s"] > 0.2  # the first step's compilation
    assert records[2]["time_compile_s"] < 0.05
    # the checkpoint of step 2 is saved after its record: it is in step 3's
    assert records[1]["time_checkpoint_s"] == 0 < records[2]["time_checkpoint_s"]
    assert first["wall_time"]["wall_s"] >= sum(r["wall_s"] for r in records) - 1e-6
    # the trace of steps 2-3
    assert glob.glob(os.path.join(wd, "profile", "plugins", "profile", "*", "*.xplane.pb"))

    resumed = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(1),
                      log=lambda s: None).train()
    assert resumed["step"] == 4
    records = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4]  # step 4 and the final eval
    final = records[-1]
    assert "val_bpb" in final and final["time_eval_s"] > 0 and final["time_checkpoint_s"] > 0
    # W&B: one offline run, continued by the resumed run, holding the same records
    run_id = open(os.path.join(wd, "wandb_run_id")).read().strip()
    runs = sorted(glob.glob(os.path.join(wd, "wandb", "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith("-" + run_id) for r in runs)
    logged = b"".join(open(f, "rb").read() for r in runs for f in glob.glob(r + "/run-*.wandb"))
    assert b"tfjax-tests" in logged
    for r in records[:-2]:
        for key in ("loss", "time_data_s", "wall_s"):  # protobuf keeps each value's JSON
            assert json.dumps(r[key]).encode() in logged, (r["step"], key)
    # step 4's row: the train record and the final evaluation merged, times added
    assert json.dumps(final["val_bpb"]).encode() in logged
    assert json.dumps(records[-2]["loss"]).encode() in logged
    both = records[-2]["wall_s"] + final["wall_s"]
    assert json.dumps(both).encode() in logged
    assert np.isfinite(final["val_bpb"])


@pytest.mark.parametrize("values,message", [
    (dict(profile_steps="3"), "train.profile_steps: got '3'; write 'A,B'"),
    (dict(profile_steps="a,b"), "train.profile_steps: got 'a,b'; write 'A,B'"),
    (dict(profile_steps="3,2"), "train.profile_steps: got '3,2'; need 1 <= A <= B <= "
                                "train.steps=10"),
    (dict(profile_steps="5,11"), "train.profile_steps: got '5,11'; need 1 <= A <= B"),
    (dict(wandb_mode="cloud"), "train.wandb_mode: got 'cloud'; allowed: 'online', 'offline', "
                               "'disabled'"),
])
def test_config_errors_name_the_field(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        C.from_dict(C.RunConfig, {"train": dict(steps=10, **values)}).validate()
