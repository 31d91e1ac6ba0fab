"""Ring attention: per-device compiled memory against single-device blockwise.

    .venv/bin/python experiments/bench_ring.py            # ~1-2 min on 2 CPU cores

For n = 1, 2, 4, 8 simulated CPU devices on a `sequence` axis and a total length
S = n * --tokens-per-device, compiles causal self-attention forward+backward
(GQA 4/1, H=64, fp32) two ways and prints `memory_analysis().temp_size_in_bytes`
(the per-device SPMD program's temporaries) and argument bytes:

- ring: `ring_attention(..., load_balance="zigzag")` (inputs in zig-zag order, as
  the data pipeline would give them);
- single: `blockwise_attention` on one device at the same total S.

The claim (issue 5): per-device ring memory stays roughly flat as S grows with n,
while single-device blockwise grows with S. Compile-only: nothing is timed, so the
CPU numbers say nothing about speed or about compute/communication overlap.
Not covered yet: ring vs all-gather step time, longest trainable sequence for a
budget, the on-paper overlap condition for H100/H200 NVLink and TPU v5p ICI.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax.ops import masks
from tfjax.ops.blockwise import blockwise_attention
from tfjax.parallel.ring_attention import ring_attention

N, K, H = 4, 1, 64


def _mib(x: int) -> str:
    return f"{x / 2**20:8.2f}"


def _compiled(fn, *args):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().memory_analysis()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-device", type=int, default=1024)
    ap.add_argument("--block", type=int, default=256)
    args = ap.parse_args()
    tpd, blk = args.tokens_per_device, args.block
    print(f"causal, GQA {N}/{K}, H={H}, fp32, fwd+bwd, {tpd} tokens per device, tiles {blk}")
    print(f"{'n':>2} {'S':>6} | {'ring temp MiB':>13} {'ring args MiB':>13} | "
          f"{'single temp MiB':>15} {'single args MiB':>15}")
    for n in (1, 2, 4, 8):
        S = n * tpd
        mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        sh = NamedSharding(mesh, P(None, "sequence"))
        q = jax.ShapeDtypeStruct((1, S, N, H), jnp.float32, sharding=sh)
        kv = jax.ShapeDtypeStruct((1, S, K, H), jnp.float32, sharding=sh)
        ring = _compiled(lambda q, k, v, mesh=mesh: ring_attention(
            q, k, v, masks.causal(), mesh=mesh, load_balance="zigzag", natural_order=False,
            block_q=blk, block_kv=blk), q, kv, kv)
        q1 = jax.ShapeDtypeStruct((1, S, N, H), jnp.float32)
        kv1 = jax.ShapeDtypeStruct((1, S, K, H), jnp.float32)
        single = _compiled(lambda q, k, v: blockwise_attention(
            q, k, v, masks.causal(), block_q=blk, block_kv=blk), q1, kv1, kv1)
        print(f"{n:>2} {S:>6} | {_mib(ring.temp_size_in_bytes):>13} "
              f"{_mib(ring.argument_size_in_bytes):>13} | {_mib(single.temp_size_in_bytes):>15} "
              f"{_mib(single.argument_size_in_bytes):>15}")


if __name__ == "__main__":
    main()
