"""Trainer tests: the helpers beside them (tiny_decoder, tiny_setup) and a compile cache."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(autouse=True)
def _compilation_cache(_cache_dir):
    """Trainers built twice from one config (resume tests) compile the same programs:
    a persistent compilation cache, fresh per session, compiles them once. Only
    while a trainer test runs; other tests in the same worker are unaffected."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    for n, v in zip(names, (_cache_dir, 0.0, 0)):
        jax.config.update(n, v)
    yield
    for n, v in saved.items():
        jax.config.update(n, v)
