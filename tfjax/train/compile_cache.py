"""JAX's persistent compilation cache for a run (`train.compilation_cache`).

`persistent_compilation_cache(setting, workdir)`, a context manager, points JAX's cache
at the directory `setting` names (`cache_directory`: "auto", the default, is the
directory JAX is configured with, else WORKDIR/compilation_cache; "workdir"; any other
path; "" is off), caches every executable compiled in the block and restores JAX's
settings after it, so a rerun or a resume of the same command finds its compiled steps
on disk. See docs/training.md ("The compilation cache").
"""

from __future__ import annotations

import contextlib
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from tfjax import storage

__all__ = ["cache_directory", "persistent_compilation_cache"]

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


def cache_directory(setting: str, workdir: str) -> str | None:
    """The directory `setting` names for a run in `workdir` (None: off)."""
    if not setting:
        return None
    if setting == "auto":
        setting = jax.config.jax_compilation_cache_dir or "workdir"
    if setting == "workdir":
        return os.path.join(workdir, "compilation_cache")
    return setting if storage.is_remote(setting) else os.path.expanduser(setting)


@contextlib.contextmanager
def persistent_compilation_cache(setting: str, workdir: str):
    """Within the block, JAX compiles through the persistent cache `setting` names
    (docs/training.md); yields the directory, or None when off."""
    path = cache_directory(setting, workdir)
    if path is None:
        yield None
        return
    old = {name: getattr(jax.config, name) for name in _OPTIONS}
    storage.path(path).mkdir(parents=True, exist_ok=True)  # JAX opens it with epath: gs:// too
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax_cache.reset_cache()  # the cache is set up once per process: again, for this path
    try:
        yield path
    finally:
        for name, value in old.items():
            jax.config.update(name, value)
        jax_cache.reset_cache()
