"""Checkpoints a user can trust: a damaged newest step falls back to an older one (kept,
moved aside, never deleted) or stops the run with the fix; a changed model shape is a
one-line error, not damage; `kill -9` during an asynchronous save leaves only finished
steps; `python -m tfjax.generate --step` names the steps that exist.

One trained workdir (4 steps, a checkpoint every step, keep=3: steps 2, 3, 4) is copied
for each test, so only the test that trains on compiles a train step."""

import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import tiny_decoder
from tiny_setup import devices, tiny_config

from tfjax.config import CheckpointConfig
from tfjax.train import Trainer
from tfjax.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CKPT = dict(enabled=True, every_steps=1, keep=3, async_save=False)
# After a damaged step's first unreadable array, orbax's reads of its other arrays are
# abandoned coroutines; the Checkpointer finalises them at once (gc), and Python reports
# their exceptions as unraisable: expected here.
pytestmark = [pytest.mark.bad_input,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def trainer(wd, logs=None, **sections):
    sections["checkpoint"] = {**CKPT, **sections.get("checkpoint", {})}
    cfg = tiny_config(mesh=dict(data=1), **sections)
    return Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(1),
                   log=(logs.append if logs is not None else lambda s: None))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _cache_dir):
    """(workdir, final params as numpy) of a 4-step run that saved steps 2, 3, 4. It
    compiles into the trainer tests' compilation cache (conftest), which is set per test,
    so that the one test here that trains on compiles nothing."""
    wd = str(tmp_path_factory.mktemp("trust") / "w")
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
    saved = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (_cache_dir, 0.0, 0, 4 << 30)):  # as conftest sets them
        jax.config.update(n, v)
    try:
        tr = trainer(wd)
        tr.train()
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)
    assert Checkpointer(wd, tr.cfg.checkpoint).all_steps() == [2, 3, 4]
    return wd, jax.tree.map(np.asarray, tr.state["params"])


@pytest.fixture
def wd(trained, tmp_path):
    """A fresh copy of the trained workdir."""
    out = str(tmp_path / "w")
    shutil.copytree(trained[0], out)
    return out


def step_dir(wd, step):
    return os.path.join(wd, "checkpoints", str(step))


def digest(path):
    """Every file under `path` (relative name, size, sha1): 'untouched' means equal."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def array_files(d):
    return sorted(glob.glob(os.path.join(d, "state", "ocdbt.process_*", "d", "*")),
                  key=os.path.getsize)


def truncate_arrays(d):
    for p in array_files(d):
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)


def delete_arrays(d):
    for p in array_files(d):
        os.remove(p)


def delete_metadata(d):
    os.remove(os.path.join(d, "state", "_METADATA"))


def garble_metadata(d):
    with open(os.path.join(d, "state", "_METADATA"), "w") as f:
        f.write("{not json")


def garble_data_position(d):
    with open(os.path.join(d, "data", "metadata"), "w") as f:
        f.write("{not json")


DAMAGE = [truncate_arrays, delete_arrays, delete_metadata, garble_metadata, garble_data_position]


@pytest.mark.parametrize("damage", DAMAGE, ids=[f.__name__ for f in DAMAGE])
def test_damaged_latest_falls_back_with_one_warning_and_is_kept(wd, damage):
    damage(step_dir(wd, 4))
    before = digest(step_dir(wd, 4))
    logs = []
    tr = trainer(wd, logs)
    state, data_state, step = tr.restore_or_init()
    assert step == 3 and data_state is not None
    warnings = [s for s in logs if "warning" in s]
    assert len(warnings) == 1 and "\n" not in warnings[0], logs
    moved = os.path.join(wd, "damaged_checkpoints", "4")
    for part in ("checkpoint step 4", step_dir(wd, 4), "restored step 3",
                 "kept, not deleted", moved):
        assert part in warnings[0], warnings[0]
    assert digest(moved) == before  # the whole step, untouched, out of orbax's sight
    assert tr.checkpointer.all_steps() == [2, 3]


def test_after_a_fallback_the_run_saves_that_step_again_and_loses_nothing(wd, trained):
    """keep=2, steps 3 and 4 saved, 4 damaged: resume from 3 and train step 4 again. The
    new step 4 is saved (had the damaged one stayed under checkpoints/, orbax could not
    save step 4 and the run's end state would be lost), step 3 is not garbage-collected
    in favour of the damaged one, which stays in damaged_checkpoints/; the resumed state
    equals the uninterrupted run's, bit for bit."""
    ckpt = os.path.join(wd, "checkpoints")
    shutil.rmtree(os.path.join(ckpt, "2"))  # as keep=2 would have left it
    truncate_arrays(step_dir(wd, 4))
    before = digest(step_dir(wd, 4))
    logs = []
    tr = trainer(wd, logs, checkpoint=dict(keep=2))
    s = tr.train()
    assert s["step"] == 4 and sorted(s["history"]) == [4], logs
    assert any("resumed from step 3" in line for line in logs), logs
    c = Checkpointer(wd, tr.cfg.checkpoint)
    assert c.all_steps() == [3, 4]
    assert digest(os.path.join(wd, "damaged_checkpoints", "4")) == before
    from tfjax.train.checkpoint import abstract_with_shardings

    restored, _, step = c.restore(abstract_with_shardings(tr.program.abstract_state,
                                                       tr.program.state_shardings))
    c.close()
    assert step == 4
    for a, b in zip(jax.tree.leaves(trained[1]), jax.tree.leaves(restored["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_fallback_false_stops_with_the_damaged_step_and_the_fix(wd):
    truncate_arrays(step_dir(wd, 4))
    before = digest(step_dir(wd, 4))
    tr = trainer(wd, checkpoint=dict(fallback=False))
    with pytest.raises(ValueError) as e:
        tr.restore_or_init()
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"checkpoint step 4 ({step_dir(wd, 4)}) cannot be read", "OUT_OF_RANGE",
                 "--config.checkpoint.fallback=True", f"remove {step_dir(wd, 4)}"):
        assert part in msg, msg
    assert digest(step_dir(wd, 4)) == before  # nothing moved or changed
    assert not os.path.exists(os.path.join(wd, "damaged_checkpoints"))


def test_no_restorable_step_is_an_error_and_changes_nothing(wd):
    for s in (2, 3, 4):
        delete_metadata(step_dir(wd, s))
    before = digest(os.path.join(wd, "checkpoints"))
    tr = trainer(wd)
    with pytest.raises(ValueError, match=r"no checkpoint under .*checkpoints can be read: "
                       r"step 4: .*; step 3: .*; step 2: .*start over with a new --workdir"):
        tr.restore_or_init()  # never a silent fresh start
    assert digest(os.path.join(wd, "checkpoints")) == before
    assert not os.path.exists(os.path.join(wd, "damaged_checkpoints"))


@pytest.mark.parametrize("model, expected", [
    (dict(d_model=64), r"params\.blocks\.0\.down has shape \(64, 32\) in the checkpoint but "
                       r"\(64, 64\) in the current model \(and \d+ more\)"),
    (dict(num_layers=3), r"params\.blocks\.2\.down \(64, 32\) is in the current model but "
                         r"not in the checkpoint"),
], ids=["d_model", "num_layers"])
def test_changed_model_is_a_one_line_error_not_damage(wd, model, expected):
    logs = []
    tr = trainer(wd, logs, model=model)
    with pytest.raises(ValueError, match=expected) as e:
        tr.restore_or_init()
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint step 4 ({step_dir(wd, 4)})" in msg, msg
    assert "new --workdir" in msg, msg
    assert not logs and tr.checkpointer.all_steps() == [2, 3, 4]  # no fallback, nothing moved


def test_resume_false_over_existing_checkpoints_is_an_error(wd):
    tr = trainer(wd, checkpoint=dict(resume=False))
    with pytest.raises(ValueError, match=r"checkpoint\.resume=False, but .*checkpoints already "
                       r"holds steps 2, 3, 4 .*use a new --workdir"):
        tr.restore_or_init()


def test_generate_names_the_steps_that_exist(wd, tmp_path, capsys):
    from tfjax.generate import main

    assert main(["--workdir", wd, "--step", "7", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--step 7: no checkpoint of that step under" in err, err
    assert "saved steps: 2, 3, 4" in err, err

    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    shutil.copy(os.path.join(wd, "config.json"), empty)
    assert main(["--workdir", empty, "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"no finished checkpoint under {os.path.join(empty, 'checkpoints')}" in err, err


# ----------------------------------------------------------------- kill -9 mid-save
SAVER = """
import sys, time
import jax.numpy as jnp
from tfjax.config import CheckpointConfig
from tfjax.train.checkpoint import Checkpointer
c = Checkpointer(sys.argv[1], CheckpointConfig(keep=3, async_save=True))
w = jnp.arange(16 * 2**20, dtype=jnp.float32)  # 64 MiB: a save long enough to interrupt
c.save(1, {"w": w}, {"pos": 1}, wait=True)
print("SAVED", flush=True)
c.save(2, {"w": w + 1}, {"pos": 2})  # asynchronous: returns while the files are written
time.sleep(600)
"""


def _kill_when(proc, pattern, timeout=120):
    """SIGKILL `proc` as soon as a path matching `pattern` exists; that path."""
    deadline = time.monotonic() + timeout
    while not (hits := glob.glob(pattern)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {pattern} appeared:\n{proc.communicate()[0]}")
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return hits[0]


def test_kill_9_during_an_async_save_leaves_only_finished_steps(tmp_path):
    wd = str(tmp_path / "w")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.Popen([sys.executable, "-c", SAVER, wd], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=dict(env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    line = p.stdout.readline()
    assert line.startswith("SAVED"), line + p.communicate()[0]
    tmp = _kill_when(p, os.path.join(wd, "checkpoints", "2.orbax-checkpoint-tmp*"))
    assert p.returncode == -signal.SIGKILL
    assert os.path.exists(tmp), "the save finished before the kill; make SAVER's array larger"
    assert not os.path.exists(os.path.join(wd, "checkpoints", "2"))

    c = Checkpointer(wd, CheckpointConfig(keep=3, async_save=False))
    assert c.latest_step() == 1 and c.all_steps() == [1]  # the half-written 2 is no step
    w = jax.ShapeDtypeStruct((16 * 2**20,), np.float32,
                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    state, data, step = c.restore({"w": w})
    assert step == 1 and data == {"pos": 1}
    np.testing.assert_array_equal(np.asarray(state["w"][:5]), np.arange(5))
    c.save(2, {"w": state["w"] + 1}, {"pos": 2}, wait=True)  # the same step saves again
    assert c.all_steps() == [1, 2] and not glob.glob(os.path.join(wd, "checkpoints", "*tmp*"))
    c.close()


@pytest.mark.slow
def test_kill_9_during_the_trainers_async_save_then_the_same_command_resumes(tmp_path,
                                                                            monkeypatch):
    """The trainer CLI (a checkpoint every step, asynchronous) killed with SIGKILL while
    the save of step >= 3 is being written: only finished steps are listed, each of them
    restores, and rerunning the same command resumes from the newest and finishes."""
    from test_cli import TINY, cli, losses

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))  # the
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # rerun compiles nothing
    wd = str(tmp_path / "w")
    args = ["--workdir", wd, "--config.train.steps=8", "--config.checkpoint.every_steps=1",
            "--config.checkpoint.keep=10", "--config.train.eval_at_end=False",
            "--config.train.sample_tokens=0", *TINY]
    p = cli(*args)
    tmp = _kill_when(p, os.path.join(wd, "checkpoints", "[3-9].orbax-checkpoint-tmp*"),
                     timeout=300)
    mid_save = os.path.exists(tmp)  # (the usual case; a Checkpointer removes it)
    in_flight = int(os.path.basename(tmp).split(".")[0])
    c = Checkpointer(wd, CheckpointConfig(keep=10, async_save=False))
    steps = c.all_steps()
    c.close()
    assert steps and max(steps) <= in_flight, (steps, in_flight)
    if mid_save:
        assert in_flight not in steps, (steps, in_flight)
    p = cli(*args)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert f"resumed from step {max(steps)}" in out, out
    assert "cannot be read" not in out, out  # nothing was damaged
    assert sorted(losses(wd)) == list(range(1, 9))
    c = Checkpointer(wd, CheckpointConfig(keep=10))
    assert c.latest_step() == 8
    c.close()
