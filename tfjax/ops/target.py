"""What the program being traced will run on: the target, not the tracing machine.

`target_platform(*arrays)` is "cpu", "gpu" or "tpu": that of the innermost
`targeting(platform, per_device=...)`, else of the mesh traced under or of an array's
sharding (`traced_platform`), else jax's default backend. `per_device()` is the active
runner of unpartitionable implementations (which `use_rules` hands down), called as
`runner(fn, q, k, v, mask, *, bias, alibi, scale, softcap, q_offset, kv_offset,
return_lse[, relative_bias])` -> fn's result, or None when nothing splits.
`gpu_lowering_target(gpu)` names the GPU the kernels are built for (`sm_count`,
`is_hopper`). See docs/attention.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from typing import Callable, Iterator

import jax

__all__ = ["GPU_COMPUTE_CAPABILITY", "GPU_SMS", "device_platform", "gpu_lowering_target",
           "is_hopper", "per_device", "sharded_outside_a_mesh", "sm_count", "target_platform",
           "targeting", "traced_platform"]


@dataclasses.dataclass(frozen=True)
class _Target:
    platform: str | None = None  # None: jax's default backend
    per_device: Callable | None = None


class _Active(threading.local):
    target: _Target = _Target()


_ACTIVE = _Active()


def device_platform(device) -> str:
    """A device's platform as dispatch names it: "cuda" and "rocm" are "gpu"."""
    platform = device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


@contextlib.contextmanager
def targeting(platform: str | None = None, *, per_device: Callable | None = None
              ) -> Iterator[None]:
    """Trace for `platform` ("cpu", "gpu", "tpu"; None: jax's default backend), with
    `per_device` as the runner of unpartitionable implementations (None: none)."""
    saved = _ACTIVE.target
    _ACTIVE.target = _Target(platform, per_device)
    try:
        yield
    finally:
        _ACTIVE.target = saved


def target_platform(*arrays) -> str:
    """The platform what is being traced will run on: `traced_platform(*arrays)`,
    else jax's default backend."""
    platform = traced_platform(*arrays)
    return platform if platform is not None else jax.default_backend()


def traced_platform(*arrays) -> str | None:
    """The platform the trace names (see the module): the active `targeting`'s
    (`use_rules`: that of the mesh's devices), the abstract mesh's, or the mesh of
    one of `arrays`' shardings; None when none does."""
    if _ACTIVE.target.platform is not None:
        return _ACTIVE.target.platform
    platform = _mesh_platform(jax.sharding.get_abstract_mesh())
    for x in arrays:
        if platform is not None:
            break
        try:
            sharding = jax.typeof(x).sharding
        except (AttributeError, TypeError):  # not an array (a python scalar, None)
            continue
        platform = _mesh_platform(getattr(sharding, "mesh", None))
    return platform


def sharded_outside_a_mesh(*arrays) -> bool:
    """True when one of `arrays`' shardings names a mesh and nothing else in the trace
    does (no active `targeting`, no mesh traced under): see the module."""
    return traced_platform() is None and traced_platform(*arrays) is not None


def _mesh_platform(mesh) -> str | None:
    """The platform of a (concrete or abstract) mesh's devices, or None (no mesh, an
    empty one, or an abstract mesh built without devices)."""
    if mesh is None or getattr(mesh, "empty", True):
        return None
    device = getattr(mesh, "abstract_device", None)
    if device is None and getattr(mesh, "devices", None) is not None:  # a concrete Mesh
        device = mesh.devices.flat[0]
    return device_platform(device) if device is not None else None


def per_device() -> Callable | None:
    """The active runner of unpartitionable implementations (see the module), or None."""
    return _ACTIVE.target.per_device


# --------------------------------------------------------------------------- #
# GPU facts.
# --------------------------------------------------------------------------- #

# Compute capability (major * 10 + minor) and SMs by GPU name, for `gpu_lowering_target`.
GPU_COMPUTE_CAPABILITY = types.MappingProxyType({
    "A100": 80, "L4": 89, "H100": 90, "H200": 90, "GH200": 90, "B200": 100, "GB200": 100})
GPU_SMS = types.MappingProxyType({
    "A100": 108, "L4": 58, "H100": 132, "H200": 132, "GH200": 132, "B200": 148, "GB200": 148})

_LOWERING: list[str] = []  # the GPUs named by active `gpu_lowering_target`s, innermost last


def sm_count() -> int:
    """Streaming multiprocessors of the GPU the kernels are built for: the one
    named by an active `gpu_lowering_target`, else the local GPU's `core_count`,
    else an H100 / H200's 132."""
    if _LOWERING:
        return GPU_SMS[_LOWERING[-1]]
    try:
        n = getattr(jax.devices()[0], "core_count", None)
    except RuntimeError:  # pragma: no cover - no backend
        n = None
    return int(n) if n else 132


def is_hopper() -> bool:
    """Whether the GPU the kernels are built for is a Hopper (sm_90): the one named
    by an active `gpu_lowering_target`, else the local device."""
    if _LOWERING:
        return GPU_COMPUTE_CAPABILITY[_LOWERING[-1]] // 10 == 9
    try:
        dev = jax.devices()[0]
        return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")
    except RuntimeError:  # pragma: no cover - no backend
        return False


@contextlib.contextmanager
def gpu_lowering_target(gpu: str = "H200") -> Iterator[None]:
    """Lower the GPU kernels for `gpu` on a machine without one: inside this
    context `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` emits
    what that GPU would run (Triton and Mosaic GPU kernels are lowered in Python;
    compiling them needs the GPU). The kernels' own choices follow the named GPU
    (`forward="auto"` picks the Hopper kernels on sm_90, `sm_count` gives its SMs),
    and jax >= 0.11's Triton lowering, which asks the local device for its compute
    capability and raises when there is no GPU, is told the named one (through
    jax's private `gpu_info` hook; jax 0.10 asks nothing). `gpu`: one of
    `GPU_COMPUTE_CAPABILITY`."""
    if gpu not in GPU_COMPUTE_CAPABILITY:
        raise ValueError(f"gpu_lowering_target: unknown gpu {gpu!r}; pass one of "
                         f"{sorted(GPU_COMPUTE_CAPABILITY)}")
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # jax 0.10
        gpu_info = None
    original = gpu_info and gpu_info.get_gpu_info
    if gpu_info is not None:
        target = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion[gpu])
        gpu_info.get_gpu_info = lambda: target
    _LOWERING.append(gpu)
    try:
        yield
    finally:
        _LOWERING.pop()
        if gpu_info is not None:
            gpu_info.get_gpu_info = original
