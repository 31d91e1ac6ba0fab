#!/usr/bin/env bash
# The one prepared run for a session that is lent an NVIDIA GPU (H100/H200):
# the accelerator tests of the GPU kernels (Triton, and the Mosaic GPU forward
# and backward on Hopper), then `bench_attention.py gpu`, then `bench_attention.py
# tune` (tile sizes) in the time left. About 9 minutes; results under $OUT.
#
# Prepare here, once (the device has no network and no ml-collections):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections==1.1.0
# Check first, here, that every row lowers for an H200 (no GPU needed; ~4 min):
#   .venv/bin/python experiments/bench_attention.py gpu --lower-only --budget-s 900
#   .venv/bin/python experiments/bench_attention.py tune --lower-only --budget-s 900
# and, better, compiles: the device runs jax 0.11.2 (CUDA 13) on Python 3.12, and a
# python3.12 venv with `pip install "jax[cuda13]==0.11.2" -e .` compiles every row with
# XLA:GPU for a deviceless H200 (Triton kernels through ptxas; ~25 min on 2 cores):
#   python experiments/bench_attention.py gpu --compile-only --budget-s 3000
# (experiments/results/attention_gpu_aot_20261130.md: every tfjax row compiled; cuDNN
# refuses H=256 and jax's Pallas attention overflows shared memory there), and
#   python experiments/gpu_registers.py --write-launch
# tabulates ptxas's registers and spills for every Triton and Mosaic GPU kernel
# configuration and writes the Triton launches chosen from it to
# tfjax/ops/pallas/triton_launch.json (~12 min on 2 cores).
# Then, with the device tool:
#   run(command="bash experiments/gpu_session.sh", carry=[".whl"], timeout_s=570)
# and copy $OUT/attention_gpu_*.md (the tiles table too) into experiments/results/.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tests/conftest.py says JAX_PLATFORMS=cpu when it sees no /dev/nvidia0; insist on the GPU.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
OUT="${OUT:-/tmp/gpu_session}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site" || exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices(), \
getattr(jax.devices()[0], 'compute_capability', '?'))" 2>&1 | tee -a "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -m accelerator \
    tests/ops/test_triton.py tests/ops/test_mosaic_gpu.py 2>&1 | tee "$OUT/accelerator_tests.log"
timeout 350 python3 experiments/bench_attention.py gpu --budget-s 260 2>&1 | tee "$OUT/bench.log"
cp experiments/results/attention_gpu_*.md "$OUT/" 2>/dev/null
# A decode step over a KV cache (packing and splitting vs xla; ~40 s)
timeout 90 python3 experiments/bench_attention.py decode --budget-s 60 2>&1 | tee "$OUT/decode.log"
cp experiments/results/attention_decode_gpu_*.md "$OUT/" 2>/dev/null
# Then the kernels' tiles, in what is left of ~560 s (rows print as measured).
left=$(( 560 - SECONDS ))
if [ "$left" -gt 40 ]; then
    timeout "$left" python3 experiments/bench_attention.py tune --budget-s $(( left - 30 )) 2>&1 \
        | tee "$OUT/tune.log"
    cp experiments/results/attention_gpu_tiles_*.md "$OUT/" 2>/dev/null
fi
echo "done"
