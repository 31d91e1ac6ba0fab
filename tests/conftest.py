"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import gc
import importlib.util
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from tfjax.platforms import has_accelerator  # noqa: E402

# With libtpu installed (the `tpu` extra, for AOT compilation tests) jax would
# probe for a TPU at start-up; on a machine without accelerators, say CPU outright
# (in the environment too, for the subprocesses tests start).
if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")

jax.config.update("jax_default_matmul_precision", "highest")

# Speed, not semantics: jax's default threefry (the "partitionable" form, which shards
# random bits without communication) compiles ~3x slower on XLA:CPU (0.94 s against
# 0.28 s per new shape, measured here), and the suite compiles ~290 `jax.random.normal`
# programs (test inputs, eager parameter init: 311 s of compile time in one CI run).
# Both forms give values independent of sharding; only the values differ.
try:
    jax.config.update("jax_threefry_partitionable", False)
except (AttributeError, KeyError):  # a jax without the option: keep its default
    pass


# Speed, not semantics: on CPU the suite's time is mostly XLA compiling (~1,800 s of
# the ~2,500 CPU-s of a CI run). Without most of XLA's optimisation passes the same
# programs compile much faster and the whole suite took 809 s instead of 1,146-1,256 s
# on 2 cores (the same 629 tests passing). Tests about what XLA's full pipeline makes
# of a program (compiled memory, compiled HLO, real TPU compilation) are marked
# `xla_optimized` and compile with it, as production does. On accelerators nothing
# changes.
FAST_COMPILE = os.environ.get("JAX_PLATFORMS") == "cpu"
if FAST_COMPILE:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session")
def one_torch_thread():
    """torch on one intra-op thread for the tests that ask (their conftests, autouse):
    idle intra-op threads spin, many CPU-seconds for tiny models on 2 cores."""
    torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _xla_optimized(request):
    """Full XLA optimisation for the duration of a test marked `xla_optimized`."""
    if not FAST_COMPILE or request.node.get_closest_marker("xla_optimized") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)


def _memory_map_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux: no such limit to keep under
        return None


MAP_LIMIT = _memory_map_limit()


def _memory_maps():
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def _under_the_memory_map_limit():
    """Each compiled XLA:CPU program holds a few memory mappings while jax caches it, and
    an xdist worker runs ~900 tests: past the kernel's `vm.max_map_count` (65530 by
    default) LLVM cannot map a new program's code and the worker dies in the compiler
    (a segfault or "LLVM ERROR: Unable to allocate section memory"). After a module
    that leaves the process over half the limit, drop jax's caches of compiled programs."""
    yield
    if MAP_LIMIT and _memory_maps() > MAP_LIMIT // 2:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def bench_attention():
    """experiments/bench_attention.py as a module, loaded once: its `relayouts` (the
    count its layer table reports) and `last_loop_body` read compiled HLO text."""
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "bench_attention.py")
    spec = importlib.util.spec_from_file_location("experiments_bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Measured slow tests (tests/slow_tests.txt: ids or id prefixes), marked `slow` here.
SLOW_TESTS = tuple(line.strip() for line in open(os.path.join(os.path.dirname(__file__),
                                                               "slow_tests.txt"))
                   if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    skip = pytest.mark.skip(reason="needs a TPU or GPU (jax backend is cpu)")
    for item in items:
        if item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        if "accelerator" in item.keywords and not on_accelerator:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gcs_emulator():
    """One local GCS emulator for the session (tests/gcs_emulator.py); its package is in
    the `cloud` extra, which `make test` installs."""
    from gcs_emulator import GcsEmulator

    emulator = GcsEmulator().start()
    yield emulator
    emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator, monkeypatch, tmp_path, request):
    """A new, empty bucket on the emulator ("gs://<name>"), with the environment (also of
    subprocesses) pointing clients at it and downloads kept under tmp_path."""
    for k, v in gcs_emulator.environment().items():
        monkeypatch.setenv(k, v)
    for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        monkeypatch.delenv(k, raising=False)  # set from STORAGE_EMULATOR_HOST (tfjax.storage)
    monkeypatch.setenv("TFJAX_DOWNLOADS", str(tmp_path / "downloads"))
    name = "t" + str(abs(hash(request.node.nodeid)))[:12] + str(time.monotonic_ns())[-6:]
    return gcs_emulator.make_bucket(name)
