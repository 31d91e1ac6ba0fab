"""The jax GPU interpreter as the Mosaic GPU kernels need it, on jax 0.10 to 0.12.

Where Pallas' GPU interpret mode stops short of what `mosaic_gpu.py` and
`mosaic_gpu_backward.py` use, this fills in the plain meaning of the operation, only
inside the interpreter and only where the installed jax does not handle it:
`gpu_interpret_params(interpret)` (the interpreter's params, its extensions installed
once) and `load(ref, layout)` (what `plgpu.load` lowers to). It reaches into
`jax._src`; a jax upgrade that breaks it shows in tests/ops/test_mosaic_gpu.py.
See docs/kernels.md.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

__all__ = ["gpu_interpret_params", "load"]


def gpu_interpret_params(interpret):
    """Pallas' GPU interpret mode (shared memory, TMA and mbarriers simulated on
    CPU) for `interpret=True`, extended where the interpreter (jax 0.10 to 0.12)
    stops short of what the Mosaic GPU kernels use (see `_extend_gpu_interpreter`);
    None when not interpreting. `interpret` may also be the interpreter's own params."""
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    if len(jax.devices("cpu")) < 4:
        # Each warpgroup runs as a concurrent CPU computation whose barrier waits
        # block runtime threads; seen here: the warp-specialised kernel hung with
        # 1 CPU device and ran with 8.
        warnings.warn("the Hopper kernel in GPU interpret mode can hang with fewer than 4 CPU "
                      "devices; set XLA_FLAGS=--xla_force_host_platform_device_count=8 (as the "
                      "tests do) or HopperConfig(compute_warpgroups=1)", stacklevel=3)

    _extend_gpu_interpreter()
    return interpret if not isinstance(interpret, bool) else InterpretGPUParams()


@functools.cache
def _extend_gpu_interpreter():
    """Semantics the GPU interpreter lacks, each the plain meaning of the
    operation: `layout_cast` (a register-layout annotation) is the identity; a
    wgmma B operand under `transpose_ref` is the transposed tile (jax 0.10; jax
    0.11 reads transposed refs itself); a wgmma A operand may be a register array
    (the RS form) rather than a shared memory ref (jax 0.10 and 0.11). Installed
    once, only into the interpreter (real lowering is untouched), and only where
    the interpreter does not handle them itself. The interpreter's internals
    changed between 0.10 and 0.11 (a thread's location: `grid_point_coords` +
    `thread_id`, then a `mesh_location` + `thread`); both are handled."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji

    if gpu_core.layout_cast_p not in mlir._platform_specific_lowerings.get("cpu", {}):
        mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    ji_cls = next(c for c in vars(ji).values()
                  if isinstance(c, type) and hasattr(c, "_interpret_wgmma_ref_p"))
    if "mesh_location" in getattr(ji_cls, "__annotations__", {}):
        _extend_wgmma_0_11(ji, ji_cls)
    else:
        _extend_wgmma_0_10(ji_cls)


def _wgmma_operands(eqn, get_invals):
    """The wgmma_ref equation's operands and their transform pytrees."""
    import jax.tree_util as jtu

    acc, a, b, *leaves = get_invals()
    empty = jax.tree.structure([])
    trees = [eqn.params[f"{x}_transforms_tree"] or empty for x in ("acc", "a", "b")]
    acc_t, a_t, b_t = jax.tree.unflatten(jtu.treedef_tuple(trees), leaves)
    return (acc, acc_t), (a, a_t), (b, b_t)


def _extend_wgmma_0_11(ji, ji_cls):
    """jax >= 0.11: the interpreter's own wgmma serves shared-memory A operands
    (transposed B included); the RS form (A a register array) gets the same
    computation with A's value passed to the callback."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
    from jax._src.state import types as state_types

    own = ji_cls._interpret_wgmma_ref_p

    def wgmma_rs(*, token, mesh_location, thread, acc_key, acc_transforms, a_value,
                 b_key, b_transforms):
        mem = cb._get_shared_memory()
        info = memory.GPULoggingInfo(mesh_location, thread, None)

        def access(key, transforms):
            key = cb.HostAllocationKey.from_array(key)
            return key, mem.access(key, jax.tree.map(int, cb._remove_noop_transforms(transforms)))

        (bk, b_access), (ak, acc_access) = access(b_key, b_transforms), access(acc_key, acc_transforms)
        b, _, _ = mem.get_buffer_content(bk, b_access, thread, logging_info=info)
        acc, _, _ = mem.get_buffer_content(ak, acc_access, thread, logging_info=info)
        res = acc + np.matmul(np.asarray(a_value), b, dtype=acc.dtype)
        mem.store_buffer_content(ak, acc_access, res, thread, logging_info=info)
        return token

    def interpret_wgmma(self, eqn, token, get_invals):
        if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
            return own(self, eqn, token, get_invals)
        (acc, acc_t), (a, _), (b, b_t) = _wgmma_operands(eqn, get_invals)
        acc, acc_t = ji.resolve_ref(eqn.invars[0].aval, acc, acc_t)
        b, b_t = ji.resolve_ref(eqn.invars[2].aval, b, b_t)
        return callback.io_callback(
            wgmma_rs, cb.TOKEN_SHAPE_DTYPE, token=token, mesh_location=self.mesh_location,
            thread=self.thread, acc_key=acc, acc_transforms=acc_t, a_value=a, b_key=b,
            b_transforms=b_t, ordered=True), []

    ji_cls._interpret_wgmma_ref_p = interpret_wgmma


def _extend_wgmma_0_10(ji_cls):
    """jax 0.10: wgmma with a transposed B tile and with a register A operand."""
    from jax._src import callback
    from jax._src.pallas.mosaic.interpret import utils as iutils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.state import types as state_types

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_key, acc_transforms,
              acc_dtype, a_key, a_value, a_transforms, b_key, b_transforms, b_transposed):
        device_id, thread_id = int(device_id), int(thread_id)
        mem = cb._get_shared_memory()
        tid = mem.get_global_thread_id(device_id, thread_id)
        info = iutils.GPULoggingInfo(device_id=device_id,
                                     grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                     thread_id=thread_id, source_info=None)

        def read(key, transforms):
            rng = iutils.to_range(jax.tree.map(int, cb._remove_noop_transforms(transforms)))
            val, _, _ = mem.get_buffer_content(cb.HostAllocationKey.from_array(key), rng, tid,
                                               logging_info=info)
            return val, rng

        b, _ = read(b_key, b_transforms)
        b = b.T if b_transposed else b
        a = a_value if a_value is not None else read(a_key, a_transforms)[0]
        acc, acc_rng = read(acc_key, acc_transforms)
        res = acc + np.matmul(np.asarray(a), b, dtype=acc_dtype)
        mem.store_buffer_content(cb.HostAllocationKey.from_array(acc_key), acc_rng, res, tid,
                                 logging_info=info)
        return token

    def interpret_wgmma(self, eqn, token, get_invals):
        (acc, acc_t), (a, a_t), (b, b_t) = _wgmma_operands(eqn, get_invals)
        transposed = [t for t in b_t if isinstance(t, state_types.TransposeTransform)]
        if transposed and (len(transposed) > 1 or b_t[-1] is not transposed[0]
                           or tuple(transposed[0].permutation) != (1, 0)):
            raise NotImplementedError("only a final (1, 0) transpose of a wgmma B operand")
        b_t = tuple(t for t in b_t if not isinstance(t, state_types.TransposeTransform))
        a_is_ref = isinstance(eqn.invars[1].aval, state_types.AbstractRef)
        return callback.io_callback(
            functools.partial(wgmma, acc_dtype=eqn.invars[0].aval.dtype,
                              b_transposed=bool(transposed)),
            cb.TOKEN_SHAPE_DTYPE, token=token, device_id=self.device_info.device_id,
            grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
            acc_key=acc, acc_transforms=acc_t, a_key=a if a_is_ref else None,
            a_value=None if a_is_ref else a, a_transforms=a_t, b_key=b, b_transforms=b_t,
            ordered=True), []

    ji_cls._interpret_wgmma_ref_p = interpret_wgmma


def load(ref, layout):
    """A ref read + layout cast: what `plgpu.load(ref, (), layout=)` lowers to
    (jax 0.10's GPU interpreter reads refs but has no rule for plgpu.load)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(ref[...], layout)
