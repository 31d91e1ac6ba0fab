"""A small NNX decoder LM that honours the model contract (logical axis names,
`model(tokens, positions, segment_ids)`, which is `model.head(model.features(...))`),
used to test the trainer on its own."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.parallel.sharding import shard


class _Draw:
    """All weights are slices of one normal draw: one RNG op keeps the init program,
    and so every test's compile, small."""

    def __init__(self, key, n):
        self.noise, self.used = jax.random.normal(key, (n,)), 0

    def __call__(self, names, shape, std=0.02):
        size = int(np.prod(shape))
        x = self.noise[self.used:self.used + size].reshape(shape) * std
        self.used += size
        return nnx.Param(x, out_sharding=names)


class Block(nnx.Module):
    def __init__(self, cfg, draw, rngs):
        D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff
        self.N, self.K, self.H = N, K, H
        self.q = draw(("embed", "heads", "head_dim"), (D, N, H))
        self.k = draw(("embed", "kv_heads", "head_dim"), (D, K, H))
        self.v = draw(("embed", "kv_heads", "head_dim"), (D, K, H))
        self.o = draw(("heads", "head_dim", "embed"), (N, H, D))
        self.up = draw(("embed", "mlp"), (D, F))
        self.down = draw(("mlp", "embed"), (F, D))
        self.n1 = nnx.Param(jnp.ones((D,)), out_sharding=("norm",))
        self.n2 = nnx.Param(jnp.ones((D,)), out_sharding=("norm",))
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x, positions, segment_ids):
        def rms(x, w):
            return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w[...]

        h = rms(x, self.n1)
        q = jnp.einsum("BTD,DNH->BTNH", h, self.q[...])
        k = jnp.einsum("BTD,DKH->BTKH", h, self.k[...])
        v = jnp.einsum("BTD,DKH->BTKH", h, self.v[...])
        q = shard(q, ("batch", "length", "heads", "head_dim"))
        # RoPE (split halves)
        half = self.H // 2
        freq = 1.0 / (10000 ** (jnp.arange(half) / half))
        ang = positions[..., None, None].astype(jnp.float32) * freq
        def rope(t):
            a, b = t[..., :half], t[..., half:]
            return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang),
                                    a * jnp.sin(ang) + b * jnp.cos(ang)], -1)
        q, k = rope(q), rope(k)
        G = self.N // self.K
        q = q.reshape(*q.shape[:2], self.K, G, self.H)
        s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) / jnp.sqrt(self.H)
        T = x.shape[1]
        mask = (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None]
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        s = jnp.where(mask[:, None, None], s, -1e30)
        p = jax.nn.softmax(s, -1)
        a = jnp.einsum("BKGTS,BSKH->BTKGH", p, v).reshape(*x.shape[:2], self.N, self.H)
        x = x + self.dropout(jnp.einsum("BTNH,NHD->BTD", a, self.o[...]))
        x = shard(x, ("batch", "length", "embed"))
        h = rms(x, self.n2)
        m = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h, self.up[...]))
        m = shard(m, ("batch", "length", "mlp"))
        x = x + self.dropout(jnp.einsum("BTF,FD->BTD", m, self.down[...]))
        return shard(x, ("batch", "length", "embed"))


class TinyDecoder(nnx.Module):
    def __init__(self, cfg, rngs):
        D, N, K, H, F, V = (cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_ff,
                            cfg.vocab_size)
        per_layer = D * N * H * 2 + D * K * H * 2 + D * F * 2
        draw = _Draw(rngs.params(), V * D + cfg.num_layers * per_layer)
        self.embed = draw(("vocab", "embed"), (V, D), std=1.0)
        self.blocks = nnx.List([Block(cfg, draw, rngs) for _ in range(cfg.num_layers)])

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.head(self.features(tokens, positions, segment_ids))

    def head(self, x):
        logits = jnp.einsum("BTD,VD->BTV", x, self.embed[...]) / jnp.sqrt(x.shape[-1])
        return shard(logits, ("batch", "length", "vocab"))

    def features(self, tokens, positions=None, segment_ids=None):
        return self.head_input(self.hidden(tokens, positions, segment_ids))

    def head_input(self, hidden):  # no final norm
        return hidden

    def hidden(self, tokens, positions=None, segment_ids=None):
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        x = self.embed[...][tokens]
        x = shard(x, ("batch", "length", "embed"))
        for blk in self.blocks:
            x = blk(x, positions, segment_ids)
        return x


def build(model_cfg, rngs):
    return TinyDecoder(model_cfg, rngs)
