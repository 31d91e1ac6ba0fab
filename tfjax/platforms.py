"""Which platforms jax probes at start-up.

Importing tfjax calls `cpu_without_accelerators()`: on a machine with no accelerator
device file and no platform chosen (`JAX_PLATFORMS` / `jax_platforms` unset), jax is
told to use the CPU, which it would fall back to anyway, without libtpu's screen of
warnings. Set `JAX_PLATFORMS` to choose otherwise. See docs/presets.md.
"""

from __future__ import annotations

import glob
import os

import jax

__all__ = ["ACCELERATOR_DEVICE_FILES", "cpu_without_accelerators", "has_accelerator"]

# TPU chips (/dev/accel*, /dev/vfio/* on v5e and later), NVIDIA and AMD GPUs.
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia[0-9]*", "/dev/kfd")


def has_accelerator() -> bool:
    """Whether this machine has a device file of a TPU or GPU."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES)


def cpu_without_accelerators() -> bool:
    """Choose the CPU platform when no platform is chosen and the machine has no
    accelerator; True when it did. Takes effect only before jax's first device query."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or has_accelerator():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
