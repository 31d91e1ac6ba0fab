"""`python -m tfjax.train` end to end with the real model (tfjax.models.build): a short
run, two processes with gloo collectives (one of them sent
SIGTERM, then resumed), and AOT compilation for a TPU slice."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.num_layers=2",
        "--config.train.batch_size=4", "--config.train.seq_len=32", "--config.train.log_every=1",
        "--config.train.eval_batches=1", "--config.train.warmup_steps=1",
        "--config.train.microbatches=1"]


def cli(*args, devices=1, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    # These tests check the CLI's plumbing (flags, eval, sampling, checkpoints, signals,
    # gloo collectives), not XLA's optimizer: compiling without most XLA optimizations
    # halves each process's compile time (the tiny model's init and train step), and
    # every process of a comparison is compiled the same way.
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "tfjax.train", "--config",
                             os.path.join(ROOT, "configs/default.py"), f"--cpu_devices={devices}",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_cli_trains_evaluates_and_samples(tmp_path):
    wd = str(tmp_path / "w")
    p = cli("--workdir", wd, "--config.train.steps=3", "--config.train.sample_tokens=8", *TINY)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert "val_bpb" in out and "gzip -9" in out and "sample (greedy)" in out
    assert sorted(losses(wd)) == [1, 2, 3]
    assert os.path.isdir(os.path.join(wd, "checkpoints", "3"))
    # (the same command resuming: test_two_processes_train_like_one_and_survive_sigterm)


@pytest.mark.bad_input
def test_cli_config_errors_are_clear(tmp_path):
    p = cli("--workdir", str(tmp_path), "--config.train.batch_size=3", "--config.mesh.data=2",
            "--config.train.microbatches=1", devices=2)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 2
    assert "train.batch_size: 3 is not divisible by the 2 batch shards" in out


@pytest.mark.bad_input
def test_cli_names_and_moved_fields_are_one_line_errors(tmp_path):
    """Before anything compiles: a name no registry has (checked at build time, but the
    CLI asks first) and an override of a field that moved into a section (which the
    locked preset would refuse with a traceback) each print one line and exit 2."""
    cases = [("--config.model.activation=swish", "config error: model.activation: got "
              "'swish'; allowed: "),
             ("--config.model.moe_d_ff=8", "config error: model.moe_d_ff moved to model.moe.d_ff"),
             ("--config.model.layer_pattern=('global','ssm')",
              "config error: model.layer_pattern[1]: got 'ssm'")]
    procs = [cli("--workdir", str(tmp_path), arg) for arg, _ in cases]
    for p, (arg, message) in zip(procs, cases):
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 2, out
        assert message in out and "Traceback" not in out, out
        assert len([line for line in out.splitlines() if "error" in line]) == 1, out


@pytest.mark.bad_input
def test_cli_input_errors_are_one_line_naming_the_file_or_field_and_the_fix(tmp_path):
    """What would be a traceback (a preset file that is not there, the default one
    outside the repository, a field that does not exist, a preset variant or a value
    that does not parse, a negative device count) is one line and exit status 2."""
    default = os.path.join(ROOT, "configs/default.py")
    cases = [
        ([f"--config={default}", "--config.model.num_layerz=3"], ROOT,
         "config error: --config.model.num_layerz: model has no field 'num_layerz' (did you "
         "mean 'num_layers'?)"),
        (["--config", "configs/nope.py"], ROOT,
         f"config error: --config configs/nope.py: no such file (relative to {ROOT}); presets "
         f"are in {ROOT}/configs"),
        ([], str(tmp_path), f"config error: no --config given, and the default "
         f"configs/default.py: no such file (relative to {tmp_path}); did you mean {default}?"),
        ([f"--config={default}:nosuch"], ROOT, "ValueError: unknown preset variant 'nosuch'; "
         "allowed: quick, small, tiny"),
        ([f"--config={default}", "--config.train.steps=abc"], ROOT,
         "config error: flag --config.train.steps=abc: invalid literal for int()"),
        ([f"--config={default}", "--cpu_devices=-2"], ROOT,
         "error: --cpu_devices must be -1 (one per core), 0 (the platform's own) or a count, "
         "got -2"),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-m", "tfjax.train", "--workdir", str(tmp_path),
                               *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args, cwd, _ in cases]
    for p, (_, _, message) in zip(procs, cases):
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 2, out
        assert message in out and "Traceback" not in out, out
        assert len([line for line in out.splitlines() if "error" in line]) == 1, out


def test_cli_sets_the_device_count_after_importing_jax():
    """`--cpu_devices` works although tfjax (and jax) are imported at the top of the
    CLI module: jax reads XLA_FLAGS when its backend starts, not on import."""
    code = ("import os, tfjax.train.__main__, tfjax.generate, jax; "
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=3'; "
            "print('DEVICES', len(jax.devices()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=120)
    assert "DEVICES 3" in p.stdout, p.stdout + p.stderr


def test_cli_default_gives_each_core_a_device():
    """`--cpu_devices` left at -1: before the backend starts, one CPU device per usable
    core that divides the batch (`use_cpu_cores`); a count in XLA_FLAGS wins."""
    code = ("import jax, tfjax.train.__main__ as m; from tfjax.config import run_config; "
            "from configs import default; "
            "from tfjax.parallel.mesh import cpu_device_count, usable_cores, use_cpu_cores; "
            "cfg = run_config(default.get_config()); use_cpu_cores(cfg.mesh, 16); "
            "print('DEVICES', len(jax.devices()), cpu_device_count(cfg.mesh, 16, usable_cores()))")
    env = dict({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, PYTHONPATH=ROOT,
               JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=120)
    devices, expected = p.stdout.split("DEVICES")[-1].split()
    assert devices == expected, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=3"),
                       timeout=120)
    assert p.stdout.split("DEVICES")[-1].split()[0] == "3", p.stdout + p.stderr


def finish(procs, timeout, what):
    """Wait for every process; one that is still running after `timeout` s is a failure
    with everyone's output (a hang, e.g. processes that disagree on the stop step and
    wait for each other in a collective), never a stuck suite."""
    deadline = time.monotonic() + timeout
    try:
        return [p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]  # kill() first: nothing blocks now
        pytest.fail(f"{what}: processes still running after {timeout}s, killed (hung?); "
                    f"their output:\n" + "\n----\n".join(outs))


@pytest.mark.slow
def test_two_processes_train_like_one_and_survive_sigterm(tmp_path, monkeypatch):
    """Two processes (gloo) train like one process, with a SIGTERM to ONE of them on the
    way: both stop at the same step, save it once, exit 143, and the same command resumes
    to the same losses. The signal goes to rank 1 after rank 0 entered train() (its
    config.json) and before the first step compiled, so the preemption sync point is
    decided during the compile, whatever the machine's speed (mid-loop, a fast machine
    could finish 3 steps before the ~1 s SIGTERM poll of the sync manager)."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))  # rerun
    # every program, however quick to compile, so the resumed run compiles nothing
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = ["--config.train.steps=3", "--config.train.sample_tokens=0", "--config.mesh.data=4",
            "--config.train.eval_at_end=False", *TINY]
    two = str(tmp_path / "two")

    def launch_two():
        return [cli("--workdir", two, *args, devices=2,
                    *[f"--coordinator_address=localhost:{port}", "--num_processes=2",
                      f"--process_id={i}"]) for i in range(2)]

    one = cli("--workdir", str(tmp_path / "one"), *args, "--config.checkpoint.enabled=False",
              devices=4)
    procs = launch_two()
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(two, "config.json")):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                pytest.fail("the two processes never reached train():\n" +
                            "\n----\n".join(p.communicate()[0] for p in procs))
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        outs = finish(procs, 300, "after SIGTERM to process 1")
        assert [p.returncode for p in procs] == [143, 143], "\n".join(outs)
        saved = [re.findall(r"\[process (\d)\] SIGTERM: saved step (\d+)", o) for o in outs]
        assert [len(x) for x in saved] == [1, 1], "\n".join(outs)  # once each
        (i0, s0), (i1, s1) = saved[0][0], saved[1][0]
        assert (i0, i1) == ("0", "1") and s0 == s1 and 1 <= int(s0) < 3, saved
        assert os.path.isdir(os.path.join(two, "checkpoints", s0))

        procs = launch_two()  # the same command again: resumes and finishes
        outs = finish([one, *procs], 400, "the resumed run")
    finally:
        for p in [one, *procs]:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(p.returncode == 0 for p in [one, *procs]), "\n".join(outs)
    assert f"resumed from step {s0}" in outs[1], outs[1]
    a, b = losses(str(tmp_path / "one")), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_read_their_own_rows_of_a_cache_mixture_like_one(tmp_path):
    """`data.source="cache"`: two processes (gloo), each reading only its rows of every
    global batch, give the losses of one process bit for bit, across a stage change."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
    from token_caches import prepared_cache

    rng = np.random.default_rng(0)
    docs = lambda n: [list(rng.integers(97, 123, rng.integers(5, 80))) for _ in range(n)]
    paths = [prepared_cache(tmp_path / name, dict(train=docs(n), validation=docs(2)))
             for name, n in (("web", 60), ("code", 30))]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = ["--config.train.steps=3", "--config.train.sample_tokens=0", "--config.mesh.data=4",
            "--config.train.eval_at_end=False", "--config.checkpoint.enabled=False",
            "--config.data.source=cache", f"--config.data.paths=('{paths[0]}', '{paths[1]}')",
            "--config.data.weights=(3.0, 1.0)", "--config.data.stages=((2, (1.0, 1.0)),)",
            "--config.data.block_rows=8", *TINY]
    one = cli("--workdir", str(tmp_path / "one"), *args, devices=4)
    two = [cli("--workdir", str(tmp_path / "two"), *args, devices=2,
               *[f"--coordinator_address=localhost:{port}", "--num_processes=2",
                 f"--process_id={i}"]) for i in range(2)]
    outs = finish([one, *two], 400, "one process and two on token caches")
    assert all(p.returncode == 0 for p in [one, *two]), "\n----\n".join(outs)
    a, b = losses(str(tmp_path / "one")), losses(str(tmp_path / "two"))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [b[k] for k in a] == [a[k] for k in a]


@pytest.mark.slow
def test_two_processes_as_two_slices_train_like_one(tmp_path):
    """`mesh.dcn_data=2` over two processes (on CPU each process stands for a slice),
    `mesh.data=2` within each: the hybrid mesh gives the losses of one process with
    data=4 (the same four shards of the batch) to float32's last bit or so: the shards'
    sums meet in another order across the processes (2026-12-06, a 2-core machine, at
    commits before and after that session's: 5.5306478 against 5.5306482, one ulp)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = ["--config.train.steps=3", "--config.train.sample_tokens=0",
            "--config.train.eval_at_end=False", "--config.checkpoint.enabled=False", *TINY]
    one = cli("--workdir", str(tmp_path / "one"), *args, "--config.mesh.data=4", devices=4)
    two = [cli("--workdir", str(tmp_path / "two"), *args, "--config.mesh.data=2",
               "--config.mesh.dcn_data=2", devices=2,
               *[f"--coordinator_address=localhost:{port}", "--num_processes=2",
                 f"--process_id={i}"]) for i in range(2)]
    outs = finish([one, *two], 400, "one process and two slices")
    assert all(p.returncode == 0 for p in [one, *two]), "\n----\n".join(outs)
    assert "'data': 4" in outs[1], outs[1]  # the mesh: dcn_data x data
    a, b = losses(str(tmp_path / "one")), losses(str(tmp_path / "two"))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=3e-7, atol=0)


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


def test_gpu_topologies_parse_and_name_the_plugin():
    """`--topology h200:8` (a host of GPUs compiled for without one): malformed or
    unknown names say the format; without jax's CUDA plugin (this project's CI) the
    error names the package to install; with it, eight deviceless H200s."""
    from tfjax.train.aot import GPU_HBM_BYTES, gpu_devices, topology_devices

    for bad in ("h200", "h200:x", "h200:0", "a100:8"):
        with pytest.raises(ValueError, match="expected <gpu>:<count>"):
            gpu_devices(bad)
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        topology_devices("v9:2x2")
    try:
        devices, hbm = topology_devices("h200:8")
    except ValueError as e:
        assert "jax[cuda13]" in str(e)
    else:
        assert len(devices) == 8 and devices[0].device_kind == "NVIDIA H200"
        assert hbm == GPU_HBM_BYTES["h200"]


@pytest.mark.bad_input
def test_tpu_topologies_without_libtpu_name_the_install_command(monkeypatch):
    """Where libtpu cannot describe the slice (not installed), the error gives the
    command that installs it from a clone (not a PyPI name tfjax does not have)."""
    from jax.experimental import topologies

    from tfjax.train.aot import tpu_devices

    def no_libtpu(**_):
        raise RuntimeError("Unable to initialize backend 'tpu'")

    monkeypatch.setattr(topologies, "get_topology_desc", no_libtpu)
    with pytest.raises(ValueError, match=r"--topology v5p:2x2x1: libtpu could not describe this "
                                         r"slice .*pip install -e '\.\[tpu\]'"):
        tpu_devices("v5p:2x2x1")
