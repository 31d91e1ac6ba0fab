"""The GPU interpreter's compatibility shims (`tfjax.ops.pallas.interpret_compat`):
the params they hand the Mosaic GPU kernels. What they make the interpreter run
(the kernels themselves): the mosaic_gpu cases of test_implementations.py."""

import warnings

from tfjax.ops.pallas.interpret_compat import gpu_interpret_params


def test_gpu_interpret_params():
    """None when not interpreting; True gives the interpreter's params (the
    extensions installed once, without warning on the suite's 8 CPU devices);
    params given are passed through."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    assert gpu_interpret_params(False) is None and gpu_interpret_params(None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = gpu_interpret_params(True)
    assert isinstance(params, InterpretGPUParams)
    assert gpu_interpret_params(params) is params
