"""Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236) with pluggable
feature maps: `out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps)`, with the running sums
`S = sum phi(k) v^T` `[H, Hv]` and `z = sum phi(k)` `[H]` of each kv head.

`linear_attention` (non-causal), `causal_linear_attention` (a chunked scan, linear in
T), `linear_attention_step` (one token) and `linear_attention_reference` (the
materialised oracle); `LinearAttention`, the mixer: `x [B, T, D] -> [B, T, D]`, GQA
over K kv heads, decode state `LinearAttentionState` (S `[B, K, H, Hv]`, z
`[B, K, H]`). Feature maps: the `FEATURE_MAPS` registry. See docs/layers.md.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import AttentionConfig, LinearConfig
from tfjax.nn.attention import head_projections
from tfjax.nn.hooks import hook
from tfjax.nn.state import DecodeState, RecurrentMixer, Slots, decode_state
from tfjax.parallel.sharding import shard
from tfjax.registry import Registry
from tfjax.typing import DType

__all__ = ["FEATURE_MAPS", "LinearAttention", "LinearAttentionState", "linear_attention",
           "causal_linear_attention", "linear_attention_step", "linear_attention_reference"]

FEATURE_MAPS: Registry = Registry("linear attention feature map")
FEATURE_MAPS.register("elu_plus_one", lambda x: jax.nn.elu(x) + 1.0)
FEATURE_MAPS.register("relu", jax.nn.relu)
FEATURE_MAPS.register("softplus", jax.nn.softplus)


@decode_state
class LinearAttentionState(DecodeState):
    """Running sums (float32): S `[B, K, H', Hv]` = sum phi(k) v^T, z `[B, K, H']` =
    sum phi(k) (H': the feature map's width). O(1) in the length."""

    S: jax.Array
    z: jax.Array
    AXES = {"S": ("batch", "kv_heads", None, None), "z": ("batch", "kv_heads", None)}


def _features(q, k, feature_map):
    phi = FEATURE_MAPS.get(feature_map, field="feature_map")
    B, T, N, _ = q.shape
    K = k.shape[2]
    qf = phi(q.astype(jnp.float32))
    return qf.reshape(B, T, K, N // K, qf.shape[-1]), phi(k.astype(jnp.float32))


def _normalise(num, den, eps):
    return num / (den[..., None] + eps)


def _documents(positions):
    """positions `[B,T]` -> document index `[B,T]` (a new one at each position 0)."""
    return jnp.cumsum((positions == 0).astype(jnp.int32), axis=1)


def linear_attention_reference(q, k, v, *, causal: bool = True,
                               feature_map: str = "elu_plus_one", eps: float = 1e-6,
                               positions=None):
    """q `[B,T,N,H]`, k `[B,S,K,H]`, v `[B,S,K,Hv]` -> `[B,T,N,Hv]` via `[T, S]` weights.
    `positions [B,T]` (causal only): keys of earlier documents are invisible."""
    B, T, N, _ = q.shape
    qf, kf = _features(q, k, feature_map)
    w = jnp.einsum("BTKGH,BSKH->BKGTS", qf, kf)
    if causal:
        w = jnp.where(jnp.tril(jnp.ones((T, k.shape[1]), bool)), w, 0.0)
    if positions is not None:
        doc = _documents(positions)
        w = jnp.where((doc[:, :, None] == doc[:, None, :])[:, None, None], w, 0.0)
    num = jnp.einsum("BKGTS,BSKM->BTKGM", w, v.astype(jnp.float32))
    den = jnp.einsum("BKGTS->BTKG", w)
    return _normalise(num, den, eps).reshape(B, T, N, -1).astype(q.dtype)


def linear_attention(q, k, v, *, causal: bool = True, feature_map: str = "elu_plus_one",
                     chunk_size: int = 64, eps: float = 1e-6, positions=None):
    """The O(T) forms: non-causal sums, or the causal chunked scan. Shapes as the reference."""
    if causal:
        return causal_linear_attention(q, k, v, feature_map=feature_map, chunk_size=chunk_size,
                                       eps=eps, positions=positions)[0]
    if positions is not None:
        raise ValueError("linear_attention: positions (document resets) need causal=True")
    B, T, N, _ = q.shape
    qf, kf = _features(q, k, feature_map)
    S = jnp.einsum("BSKH,BSKM->BKHM", kf, v.astype(jnp.float32))
    num = jnp.einsum("BTKGH,BKHM->BTKGM", qf, S)
    den = jnp.einsum("BTKGH,BKH->BTKG", qf, kf.sum(1))
    return _normalise(num, den, eps).reshape(B, T, N, -1).astype(q.dtype)


def causal_linear_attention(q, k, v, *, feature_map: str = "elu_plus_one", chunk_size: int = 64,
                            eps: float = 1e-6, state: LinearAttentionState | None = None,
                            positions=None, lengths=None):
    """Causal form from `state` (None: empty) -> (out `[B,T,N,Hv]`, final state).

    Chunks of `chunk_size` steps: quadratic inside a chunk, a carried state across.
    `positions [B,T]`: a step at position 0 starts a document (state dropped there).
    `lengths [B]`: row b has lengths[b] real steps, then right padding that does not
    enter the final state."""
    B, T, N, _ = q.shape
    K, Hv = k.shape[2], v.shape[-1]
    if k.shape[1] != T:
        raise ValueError(f"causal linear attention needs as many keys as queries, got T={T}, "
                         f"S={k.shape[1]}")
    qf, kf = _features(q, k, feature_map)  # [B,T,K,G,H'], [B,T,K,H']
    if lengths is not None:  # padding keys get zero features
        valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
        kf = jnp.where(valid[..., None, None], kf, 0.0)
    Hf = kf.shape[-1]
    vf = v.astype(jnp.float32)
    if state is None:
        state = LinearAttentionState(jnp.zeros((B, K, Hf, Hv), jnp.float32),
                                     jnp.zeros((B, K, Hf), jnp.float32))
    c = max(1, min(chunk_size, T))
    pad = (-T) % c
    # Document of each step; the state entering the call belongs to document 0.
    doc = jnp.zeros((B, T), jnp.int32) if positions is None else _documents(positions)
    if pad:  # padded keys get zero features so they add nothing to the state
        qf = jnp.pad(qf, [(0, 0), (0, pad)] + [(0, 0)] * 3)
        kf = jnp.pad(kf, [(0, 0), (0, pad)] + [(0, 0)] * 2)
        vf = jnp.pad(vf, [(0, 0), (0, pad)] + [(0, 0)] * 2)
        doc = jnp.pad(doc, [(0, 0), (0, pad)], mode="edge")

    def chunks(a):
        return a.reshape(B, -1, c, *a.shape[2:]).swapaxes(0, 1)  # [nc, B, c, ...]

    tril = jnp.tril(jnp.ones((c, c), bool))

    @jax.checkpoint
    def body(carry, xs):
        S, z, prev = carry  # prev [B]: the document the carried state belongs to
        qc, kc, vc, dc = xs
        same = (dc[:, :, None] == dc[:, None, :])[:, None, None]  # [B,1,1,c,c]
        w = jnp.where(tril & same, jnp.einsum("BTKGH,BSKH->BKGTS", qc, kc), 0.0)
        use = (dc == prev[:, None]).astype(qc.dtype)[:, :, None, None]  # [B,c,1,1]
        num = jnp.einsum("BKGTS,BSKM->BTKGM", w, vc) + \
            jnp.einsum("BTKGH,BKHM->BTKGM", qc, S) * use[..., None]
        den = jnp.einsum("BKGTS->BTKG", w) + jnp.einsum("BTKGH,BKH->BTKG", qc, z) * use
        last = dc[:, -1]
        keep = (last == prev).astype(S.dtype)  # no document started in this chunk
        kin = kc * (dc == last[:, None]).astype(kc.dtype)[..., None, None]  # keys of the last doc
        S = S * keep[:, None, None, None] + jnp.einsum("BSKH,BSKM->BKHM", kin, vc)
        z = z * keep[:, None, None] + kin.sum(1)
        return (S, z, last), _normalise(num, den, eps)

    carry = (state.S, state.z, jnp.zeros((B,), jnp.int32))
    (S, z, _), out = jax.lax.scan(body, carry, (chunks(qf), chunks(kf), chunks(vf), chunks(doc)))
    out = out.swapaxes(0, 1).reshape(B, -1, N, Hv)[:, :T]
    return out.astype(q.dtype), LinearAttentionState(S, z)


def linear_attention_step(q_t, k_t, v_t, state: LinearAttentionState, *,
                          feature_map: str = "elu_plus_one", eps: float = 1e-6):
    """One token: q_t `[B,N,H]`, k_t `[B,K,H]`, v_t `[B,K,Hv]` -> (out `[B,N,Hv]`, state)."""
    B, N, _ = q_t.shape
    qf, kf = _features(q_t[:, None], k_t[:, None], feature_map)
    qf, kf = qf[:, 0], kf[:, 0]  # [B,K,G,H'], [B,K,H']
    S = state.S + jnp.einsum("BKH,BKM->BKHM", kf, v_t.astype(jnp.float32))
    z = state.z + kf
    num = jnp.einsum("BKGH,BKHM->BKGM", qf, S)
    den = jnp.einsum("BKGH,BKH->BKG", qf, z)
    return _normalise(num, den, eps).reshape(B, N, -1).astype(q_t.dtype), LinearAttentionState(S, z)


class LinearAttention(RecurrentMixer):
    """`x [B,T,D] -> [B,T,D]`: q/k/v/o projections as `MultiHeadAttention`, linear kernel;
    `linear` (`tfjax.config.LinearConfig`): the feature map and the causal form's chunk;
    `attention` (`tfjax.config.AttentionConfig`): only its `qkv_bias` and `out_bias`
    are read (the projections' biases, as the softmax attention layers have them)."""

    def __init__(self, d_model: int, num_heads: int, linear: LinearConfig = LinearConfig(), *,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 attention: AttentionConfig = AttentionConfig(), causal: bool = True,
                 eps: float = 1e-6, dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        feature_map, chunk_size = linear.feature_map, linear.chunk
        FEATURE_MAPS.get(feature_map, field="feature_map")
        K = num_kv_heads or num_heads
        if num_heads % K:
            raise ValueError(f"num_kv_heads={K} must divide num_heads={num_heads}")
        H = head_dim or d_model // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, K, H
        self.feature_map, self.chunk_size, self.causal, self.eps = feature_map, chunk_size, causal, eps
        self.q, self.k, self.v, self.o = head_projections(
            d_model, num_heads, K, H, qkv_bias=attention.qkv_bias, out_bias=attention.out_bias,
            dtype=dtype, param_dtype=param_dtype, init_std=init_std, out_init_std=out_init_std,
            rngs=rngs)

    def project(self, x):
        q = shard(self.q(x), ("batch", "length", "heads", "head_dim"))
        k = shard(self.k(x), ("batch", "length", "kv_heads", "head_dim"))
        v = shard(self.v(x), ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def init_state(self, batch: int, size: int = 0, dtype=jnp.float32, *,
                   window: int = 0) -> LinearAttentionState:
        """The empty running sums, float32 whatever `dtype` (`size` and `window`, a
        position-indexed state's geometry in the mixers' shared protocol, do not apply:
        it is O(1))."""
        Hf = FEATURE_MAPS.get(self.feature_map)(jnp.zeros((self.head_dim,))).shape[-1]
        K = self.num_kv_heads
        return LinearAttentionState(jnp.zeros((batch, K, Hf, self.head_dim), jnp.float32),
                                    jnp.zeros((batch, K, Hf), jnp.float32))

    def forward(self, x, state: LinearAttentionState | None = None, *, positions=None,
                lengths=None):
        """Causal: x `[B,T,D]` from `state` -> (y `[B,T,D]`, final state) (prefill).
        `positions`: a step at position 0 starts a new document; `lengths [B]`: real
        steps per row (right padding stays out of the state)."""
        q, k, v = self.project(x)
        out, state = causal_linear_attention(q, k, v, feature_map=self.feature_map,
                                             chunk_size=self.chunk_size, eps=self.eps, state=state,
                                             positions=positions, lengths=lengths)
        return self.o(out), state

    def step(self, x_t, state: LinearAttentionState):
        """One token x_t `[B, D]` -> (y_t `[B, D]`, state). O(1) in the length."""
        q, k, v = self.project(x_t[:, None])
        out, state = linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state,
                                           feature_map=self.feature_map, eps=self.eps)
        return self.o(out[:, None])[:, 0], state

    def __call__(self, x, *, mask=None, bias=None, positions=None,
                 state: LinearAttentionState | None = None, slots: Slots | None = None, **_):
        """Block interface: causal (or not) by construction; `mask` and `bias` are
        unused; `positions` only mark document starts (position 0) in the causal form
        (no position encoding inside a linear kernel). With `state` (`init_state`;
        causal only) it returns `(y, new_state)`: one sequence from the state, or with
        the step's `slots` each row's real new tokens."""
        del mask, bias
        if state is not None:
            if not self.causal:
                raise ValueError("generation needs causal linear attention (LinearAttention("
                                 "causal=True)); a non-causal layer has no running state")
            return super().__call__(x, positions=positions, state=state, slots=slots)
        q, k, v = self.project(x)
        if self.causal:
            out, final = causal_linear_attention(q, k, v, feature_map=self.feature_map,
                                                 chunk_size=self.chunk_size, eps=self.eps,
                                                 positions=positions)
            # capture points (tfjax.nn.hooks): nothing in this call reads the final state
            hook("hook_state", final.S), hook("hook_state_norm", final.z)
        else:
            out = linear_attention(q, k, v, causal=False, feature_map=self.feature_map,
                                   chunk_size=self.chunk_size, eps=self.eps)
        out = hook("hook_z", out)  # [B, T, N, Hv]: each head's output, as attention's
        return shard(self.o(out), ("batch", "length", "embed"))
