"""Trainer tests: the helpers beside them (tiny_decoder, tiny_setup) and a compile cache."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory):
    """Fresh per test session. Under pytest-xdist, one directory for all workers (the
    parent of their temporary directories): a program compiled by one worker, e.g. the
    one-device reference both workers' trainer tests compare with, is read by the other."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # no xdist
        return str(tmp_path_factory.mktemp("jax_cache"))
    path = tmp_path_factory.getbasetemp().parent / "jax_cache_train"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(autouse=True)
def _compilation_cache(_cache_dir):
    """Trainers built twice from one config (resume tests) compile the same programs:
    a persistent compilation cache, fresh per session, compiles them once. Only
    while a trainer test runs; other tests in the same worker are unaffected."""
    import jax

    # A size limit turns on jax's LRU eviction, and with it the file lock around every
    # read and write: two workers never read an entry while the other writes it.
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
    saved = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (_cache_dir, 0.0, 0, 4 << 30)):
        jax.config.update(n, v)
    yield
    for n, v in saved.items():
        jax.config.update(n, v)
