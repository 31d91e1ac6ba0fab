"""Multi-head Latent Attention's absorbed decode step compiled for a TPU by the real
XLA:TPU compiler on this CPU (libtpu's topology descriptions, the `tpu` extra): the
step attends over the latent cache without rebuilding per-head keys or values (no
matmul in the compiled step produces anything of the size of per-head K/V for the
cached prefix; XLA may place such a buffer in VMEM, where memory_analysis does not
count it, so the HLO is what is checked)."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tfjax import models
from tfjax.config import model_config

pytest.importorskip("libtpu", reason="the tpu extra (libtpu) is not installed")
from tfjax.train.aot import tpu_devices  # noqa: E402

B, S, N = 4, 4096, 8
MLA = dict(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)


def test_absorbed_decode_compiles_for_tpu_without_per_head_kv():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices, _ = tpu_devices("v5e:2x2")
    cfg = model_config(dict(arch="decoder", vocab_size=512, d_model=256, num_layers=2,
                            num_heads=N, d_ff=512, max_len=S, layer_pattern=("mla",), mla=MLA,
                            dtype="bfloat16"))
    model = models.build(cfg)
    graphdef, state = nnx.split(model)
    rep = NamedSharding(Mesh(np.asarray(devices[:1]), ("data",)), P())

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)

    def decode(state, cache, tokens):
        return nnx.merge(graphdef, state).step(tokens, cache)

    cache = jax.eval_shape(lambda: model.init_cache(B, S))
    compiled = jax.jit(decode).lower(abstract(state), abstract(cache),
                                     jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=rep)
                                     ).compile()
    latent_bytes = B * S * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 2 * cfg.num_layers
    per_head_k = B * S * N * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]) * 2  # one layer
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes >= latent_bytes  # the cache holds only the latents
    assert mem.temp_size_in_bytes < per_head_k / 4, (mem.temp_size_in_bytes, per_head_k)
    dots = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:dot|convolution)\(", compiled.as_text())
    sizes = [math.prod(int(d) for d in shape.split(",") if d) for shape in dots]
    assert dots and max(sizes) < B * S * N * 8, sorted(sizes)[-3:]  # scores are B*S*N
