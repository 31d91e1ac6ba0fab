"""JAX's persistent compilation cache for a run (`train.compilation_cache`).

A rerun or a resume of the same command finds its compiled steps on disk instead
of compiling them again: `persistent_compilation_cache(setting, workdir)` points
JAX's cache (`jax_compilation_cache_dir`) at

- "auto" (the default): the directory JAX is already configured with
  (`JAX_COMPILATION_CACHE_DIR` or `jax_compilation_cache_dir`), else
  WORKDIR/compilation_cache;
- "workdir": WORKDIR/compilation_cache, kept with the run;
- any other non-empty string: that directory (e.g. one shared by many runs);
- "" : off (JAX's own setting, if the user made one, is left as it is);

for the duration of the `with` block, caching every executable the run compiles
(the minimum compile time is 0), and restores JAX's previous settings after it. The
cache is keyed by the program, the compiler options and the devices, so a hit
runs the same executable a fresh compile would have produced; a changed model
or mesh simply compiles anew.
"""

from __future__ import annotations

import contextlib
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

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
    return os.path.expanduser(setting)


@contextlib.contextmanager
def persistent_compilation_cache(setting: str, workdir: str):
    """Within the block, JAX compiles through the persistent cache `setting` names
    (see the module docstring); yields the directory, or None when off."""
    path = cache_directory(setting, workdir)
    if path is None:
        yield None
        return
    old = {name: getattr(jax.config, name) for name in _OPTIONS}
    os.makedirs(path, exist_ok=True)
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
