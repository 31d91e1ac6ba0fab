"""`--compile_only --topology v5p:4x4x4`: AOT-compile the real sharded train step for a
TPU slice on a CPU-only machine (libtpu's topology descriptions, the `tpu` extra) and
print per-device memory: parameters, optimizer state, temporaries, and whether it
fits the chip's HBM. Without --topology it compiles for the local devices.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp

from tfjax.config import RunConfig, model_config
from tfjax.parallel.mesh import make_mesh

__all__ = ["HBM_BYTES", "compile_only", "tpu_devices"]

GiB = 1024 ** 3
# HBM per chip.
HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB,
             "v6e": 32 * GiB}


def tpu_devices(topology: str):
    """Compile-only devices of a TPU slice, e.g. "v5e:2x2" or "v5p:4x4x4"."""
    from jax.experimental import topologies

    # libtpu guards a real TPU with a lockfile; a compile-only topology needs no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if ":" not in topology:
        raise ValueError(f"--topology: expected <chip>:<shape> such as v5e:2x2 or v5p:4x4x4, "
                         f"got {topology!r}")
    chip, shape = topology.split(":", 1)
    if chip not in HBM_BYTES:
        raise ValueError(f"--topology: unknown chip {chip!r}; known: {', '.join(HBM_BYTES)}")
    dims = [int(d) for d in shape.split("x")]
    dims += [1] * (3 - len(dims))
    host = [min(d, 2) for d in dims[:2]] + [1]
    try:
        topo = topologies.get_topology_desc(
            topology_name=f"{chip}:{shape}", platform="tpu", chip_config_name="default",
            chips_per_host_bounds=tuple(host), num_slices=1,
            wrap=tuple(d >= 4 for d in dims))
    except Exception as e:
        raise ValueError(f"--topology {topology}: libtpu could not describe this slice ({e}); "
                         "install the tpu extra: pip install 'tfjax[tpu]'") from e
    return list(topo.devices), HBM_BYTES[chip]


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 1024 ** 2:.1f} MiB"


def _per_device_bytes(abstract, shardings) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def compile_only(cfg: RunConfig, topology: str | None, build_model=None, out=sys.stdout) -> int:
    from tfjax.data.tokenizers import load_tokenizer
    from tfjax.train.trainer import _default_builder, build_program, check_run

    model_config(cfg.model)
    if topology:
        devices, hbm = tpu_devices(topology)
    else:
        devices, hbm = jax.devices(), None
    mesh = make_mesh(cfg.mesh, devices)
    check_run(cfg, mesh, load_tokenizer(cfg.data.tokenizer))
    p = build_program(cfg, mesh, build_model or _default_builder())
    t = cfg.train
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  p.abstract_state, p.state_shardings)
    batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=p.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "mask", "target_bytes")}
    compiled = p.step.lower(abstract_state, batch).compile()
    mem = compiled.memory_analysis()
    params = _per_device_bytes(p.abstract_state["params"], p.state_shardings["params"])
    opt = _per_device_bytes(p.abstract_state["opt"], p.state_shardings["opt"])
    temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0) if mem is not None else 0
    code = int(getattr(mem, "generated_code_size_in_bytes", 0) or 0) if mem is not None else 0
    total = params + opt + temp + code
    where = topology or f"{len(devices)} local {devices[0].platform} device(s)"
    lines = [
        f"compiled train step for {where}, mesh {dict(mesh.shape)}",
        f"  model: {p.num_params / 1e6:,.1f}M parameters ({cfg.model.param_dtype}), "
        f"global batch {t.batch_size} x {t.seq_len}",
        f"  per device: parameters {_fmt(params)}, optimizer {_fmt(opt)}, "
        f"temporaries {_fmt(temp)}, code {_fmt(code)} -> {_fmt(total)}",
    ]
    if hbm:
        lines.append(f"  HBM per chip {hbm / GiB:.0f} GiB: "
                     f"{'FITS' if total <= hbm else 'DOES NOT FIT'} ({100 * total / hbm:.0f}%)")
    print("\n".join(lines), file=out)
    return 0 if (hbm is None or total <= hbm) else 1
