"""Multi-head Latent Attention: the KV cache it keeps, and its absorbed decode.

    .venv/bin/python experiments/mla_cache.py            # full: ~2 CPU-minutes
    .venv/bin/python experiments/mla_cache.py --quick    # seconds (CI)

1. Cache bytes per token (all layers, bf16) from `tfjax.models.kv_bytes_per_token`
   (the increment of `cache_bytes`, abstract: `init_cache` under `jax.eval_shape`) at
   Llama-3-8B's shapes (32 layers, 32 query heads of 128) as MHA, GQA (K = 8) and
   MQA, and at DeepSeek-V3's (61 layers, 128 heads; q/k 192 = 128 + 64 rotary, v
   128) as MHA with those head dims, GQA (K = 8), MQA and MLA (a latent of 512 and
   one rotary key of 64 per token). DeepSeek's claim (V2 paper, table 1): MLA's
   cache is a small fraction of MHA's, about that of GQA with 2.25 groups.
2. Decode-step time on this CPU of one MLA layer over a latent cache holding a
   prefix, against the prefix length: the absorbed form (`attend_absorbed`: the key
   up-projection folded into the queries, MQA over the latents) next to the
   materialised form over the same cache (`attend`: per-head K and V rebuilt from
   every cached latent at every step), both jitted, best of N; B = 1.
"""

from __future__ import annotations

from common import Experiment
from tinylm import best_of

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import models
from tfjax.config import MLAConfig, model_config
from tfjax.nn.latent_attention import MultiHeadLatentAttention
from tfjax.ops import masks


def cache_rows():
    llama = dict(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, head_dim=128,
                 d_ff=14336, dtype="bfloat16")
    v3 = dict(vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, d_ff=18432,
              dtype="bfloat16")
    kinds = {
        "Llama-3-8B MHA": dict(llama),
        "Llama-3-8B GQA K=8": dict(llama, num_kv_heads=8),
        "Llama-3-8B MQA": dict(llama, num_kv_heads=1),
        "DeepSeek-V3 MHA (192 / 128)": dict(v3, head_dim=192, v_head_dim=128),
        "DeepSeek-V3 GQA K=8": dict(v3, head_dim=192, v_head_dim=128, num_kv_heads=8),
        "DeepSeek-V3 MQA": dict(v3, head_dim=192, v_head_dim=128, num_kv_heads=1),
        "DeepSeek-V3 MLA (512 + 64)": dict(v3, layer_pattern=("mla",), mla=dict(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128)),
    }
    rows, mha = [], {}
    for name, kw in kinds.items():
        per_token = models.kv_bytes_per_token(model_config(kw))
        family = name.split(" ")[0]
        mha.setdefault(family, per_token)
        rows.append([name, per_token, per_token // (kw["num_layers"] * 2),
                     per_token / mha[family]])
    return rows


def decode_rows(dims, prefixes, reps):
    d, N, r, dr, dn, dv = dims
    mla = MLAConfig(kv_lora_rank=r, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv,
                    q_lora_rank=r)
    layer = MultiHeadLatentAttention(d, N, mla, rngs=nnx.Rngs(0))
    absorbed = nnx.jit(lambda m, *a: m.attend_absorbed(*a))
    materialised = nnx.jit(lambda m, *a: m.attend(*a))
    rows = []
    for S in prefixes:
        x = jax.random.normal(jax.random.key(S), (1, S, d))
        pos = jnp.arange(S)[None]
        latent = layer.latent(x, pos)  # the cache after S tokens
        q_nope, q_pe = layer.queries(x[:, -1:], pos[:, -1:])
        mask = masks.positions(pos[:, -1:], pos)
        args = (q_nope, q_pe, latent, mask)
        a = absorbed(layer, *args)
        m = materialised(layer, *args)
        err = float(jnp.abs(a - m).max())
        t_abs = best_of(lambda: absorbed(layer, *args), reps)
        t_mat = best_of(lambda: materialised(layer, *args), reps)
        rows.append([S, 1e3 * t_abs, 1e3 * t_mat, t_mat / t_abs, err])
    return rows


def main(argv=None):
    exp = Experiment("mla_cache", __doc__, argv=argv)
    exp.table(["attention", "cache bytes per token", "values per token per layer",
               "vs its MHA"], cache_rows(),
              title="1. Cache bytes per token, all layers, bf16")
    if exp.quick:
        dims, prefixes, reps = (64, 4, 32, 8, 16, 16), (64, 256), 3
    else:
        dims, prefixes, reps = (1024, 16, 256, 32, 64, 64), (512, 1024, 2048, 4096, 8192), 10
    d, N, r, dr, dn, dv = dims
    rows = decode_rows(dims, prefixes, reps)
    exp.table(["prefix", "absorbed ms", "materialised ms", "materialised / absorbed",
               "max |difference|"], rows,
              title=f"2. One MLA layer's decode step (d_model {d}, {N} heads, latent {r} + "
                    f"rotary {dr}, nope {dn}, v {dv}; fp32, B = 1, best of {reps})")
    exp.plot({"absorbed": ([x[0] for x in rows], [x[1] for x in rows]),
              "materialised": ([x[0] for x in rows], [x[2] for x in rows])},
             xlabel="prefix (tokens)", ylabel="ms per decode step", logx=True, logy=True)
    return exp.finish()


if __name__ == "__main__":
    main()
