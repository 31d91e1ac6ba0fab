"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464), the
linear-attention mixer of Qwen3-Next: per value head a state S `[d_k, d_v]`,
`S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`, `o_t = S_t^T q_t`.

`GatedDeltaNet(d_model, gdn)`: `x [B, T, D] -> [B, T, D]`, trained in the chunked form
`gated_delta_rule` (float32; its ground truth `gated_delta_rule_reference`), value
heads in GVA groups of the q/k heads. Decoding is O(1) per token: `init_state` gives a
`GatedDeltaNetState`, `step(x_t, state)` advances one token and `forward(x, state,
positions=, lengths=)` a prompt; packed documents (`positions`) and right padding
(`lengths`) never mix into the state. See docs/layers.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import GatedDeltaNetConfig
from tfjax.nn.hooks import hook
from tfjax.nn.norms import make_norm
from tfjax.nn.ssm import causal_conv, dt_bias_init, last_conv_inputs
from tfjax.nn.state import DecodeState, RecurrentMixer, decode_state
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import DType

__all__ = ["GatedDeltaNet", "GatedDeltaNetState", "gated_delta_rule",
           "gated_delta_rule_reference", "gated_delta_step", "l2_normalize"]

QK_AXES = ("batch", "length", "kv_heads", "head_dim")
V_AXES = ("batch", "length", "heads", "head_dim")


@decode_state
class GatedDeltaNetState(DecodeState):
    """Decoding state of one layer: the last d_conv - 1 conv inputs, conv_q, conv_k
    `[B, d_conv - 1, Hk, dk]`, conv_v `[B, d_conv - 1, Hv, dv]`, and the delta-rule
    state S `[B, Hv, dk, dv]` (float32). O(1) in the length."""

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    S: jax.Array
    AXES = {"conv_q": ("batch", None, "kv_heads", "head_dim"),
            "conv_k": ("batch", None, "kv_heads", "head_dim"),
            "conv_v": ("batch", None, "heads", "head_dim"), "S": ("batch", "heads", None, None)}


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis (fla's and HF's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _grouped(q, k, v, g, beta, state):
    """float32 and value heads split as `[.., K, G, ..]`: v `[B,T,K,G,M]`, g, beta
    `[B,T,K,G]`, S `[B,K,G,H,M]` (zeros if `state` is None)."""
    f32 = jnp.float32
    B, T, K, H = k.shape
    N, M = v.shape[2:]
    if N % K or q.shape != k.shape:
        raise ValueError(f"gated delta rule: q and k `[B,T,K,H]` alike and num_v_heads={N} "
                         f"a multiple of num_k_heads={K}; got q {q.shape}, k {k.shape}")
    G = N // K
    S = (jnp.zeros((B, K, G, H, M), f32) if state is None
         else state.astype(f32).reshape(B, K, G, H, M))
    return (q.astype(f32), k.astype(f32), v.astype(f32).reshape(B, T, K, G, M),
            g.astype(f32).reshape(B, T, K, G), beta.astype(f32).reshape(B, T, K, G), S)


def gated_delta_step(q_t, k_t, v_t, alpha_t, beta_t, S):
    """One step in grouped shapes: q_t, k_t `[B,K,H]`, v_t `[B,K,G,M]`, alpha_t, beta_t
    `[B,K,G]`, S `[B,K,G,H,M]` -> (o_t `[B,K,G,M]`, S_t)."""
    S = alpha_t[..., None, None] * S
    u = beta_t[..., None] * (v_t - jnp.einsum("BKH,BKGHM->BKGM", k_t, S))
    S = S + jnp.einsum("BKH,BKGM->BKGHM", k_t, u)
    return jnp.einsum("BKH,BKGHM->BKGM", q_t, S), S


def gated_delta_rule_reference(q, k, v, g, beta, *, state=None, reset=None):
    """The sequential recurrence (a `lax.scan` over T; ground truth for tests).

    q, k `[B,T,Hk,H]` (normalised and scaled by the caller), v `[B,T,Hv,M]`, g (log
    decay, <= 0) and beta `[B,T,Hv]`, state `[B,Hv,H,M]` or None, reset `[B,T]` bool
    (the state is zeroed before that step) or None -> (o `[B,T,Hv,M]` float32, S_T)."""
    B, T, _, H = k.shape
    N, M = v.shape[2:]
    q, k, v, g, beta, S = _grouped(q, k, v, g, beta, state)
    alpha = jnp.exp(g)
    if reset is not None:
        alpha = jnp.where(reset[:, :, None, None], 0.0, alpha)

    def body(S, xs):
        o, S = gated_delta_step(*xs, S)
        return S, o

    S, o = jax.lax.scan(body, S, tuple(a.swapaxes(0, 1) for a in (q, k, v, alpha, beta)))
    return o.swapaxes(0, 1).reshape(B, T, N, M), S.reshape(B, N, H, M)


def gated_delta_rule(q, k, v, g, beta, *, chunk_size: int = 64, state=None, reset=None):
    """The chunked (WY / UT transform) form; arguments and result as the reference's.

    Chunks of `chunk_size` steps (T padded internally to a multiple): a triangular
    solve per chunk, all chunks at once, then a `lax.scan` across chunks carrying S.
    `reset [B,T]`: a document starts at that step (nothing before it is seen)."""
    B, T, K, H = k.shape
    N, M = v.shape[2:]
    q, k, v, g, beta, S0 = _grouped(q, k, v, g, beta, state)
    # The document of each step; the state entering the call belongs to document 0.
    doc = (jnp.zeros((B, T), jnp.int32) if reset is None
           else jnp.cumsum(reset.astype(jnp.int32), axis=1))
    c = max(1, min(chunk_size, T))
    pad = (-T) % c
    n = (T + pad) // c

    def chunks(a, mode="constant"):  # [B, T, ...] -> [B, n, c, ...]; zeros: no write, no decay
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode=mode)
        return a.reshape(B, n, c, *a.shape[2:])

    q, k, v, g, beta, doc = (chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta),
                             chunks(doc, "edge"))
    # The document the carried state belongs to when each chunk starts.
    prev = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1, -1]], axis=1)  # [B, n]
    cum = jnp.cumsum(g, axis=2)  # [B, n, c, K, G]: log decay from the chunk start
    tril = jnp.tril(jnp.ones((c, c), bool))
    same = ((doc[:, :, :, None] == doc[:, :, None, :]) & tril)[..., None, None]  # [B,n,I,J,1,1]
    diff = cum[:, :, :, None] - cum[:, :, None, :]  # [B, n, I, J, K, G]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # Gamma_ij, j <= i
    live = (doc == prev[..., None])[..., None, None]  # [B, n, c, 1, 1]: sees the carried state
    d = jnp.where(live, jnp.exp(cum), 0.0)  # [B, n, c, K, G]

    strict = ~jnp.eye(c, dtype=bool)[..., None, None]
    kk = jnp.einsum("BnIKH,BnJKH->BnIJK", k, k)[..., None]
    A = jnp.where(strict, beta[:, :, :, None] * decay * kk, 0.0)  # [B, n, I, J, K, G]
    L = jnp.moveaxis(A, (2, 3), (4, 5)) + jnp.eye(c)  # [B, n, K, G, I, J], unit lower
    rhs = jnp.concatenate([beta[..., None] * v,  # [B, n, c, K, G, M + H]
                           (beta * d)[..., None] * k[:, :, :, :, None, :]], axis=-1)
    UW = jax.lax.linalg.triangular_solve(L, jnp.moveaxis(rhs, 2, 4), left_side=True,
                                         lower=True, unit_diagonal=True)  # [B,n,K,G,c,M+H]
    U, W = UW[..., :M], UW[..., M:]
    P = decay * jnp.einsum("BnIKH,BnJKH->BnIJK", q, k)[..., None]  # in-chunk attention
    qd = q[:, :, :, :, None, :] * d[..., None]  # [B, n, c, K, G, H]: queries of the carried S
    kd = k[:, :, :, :, None, :] * decay[:, :, -1][..., None]  # keys decayed to the chunk end
    dend = d[:, :, -1]  # [B, n, K, G]: the carried S's decay over the whole chunk

    @jax.checkpoint
    def body(S, xs):
        U, W, P, qd, kd, dend = xs
        u = U - jnp.einsum("BKGJH,BKGHM->BKGJM", W, S)
        o = (jnp.einsum("BIKGH,BKGHM->BIKGM", qd, S)
             + jnp.einsum("BIJKG,BKGJM->BIKGM", P, u))
        S = dend[..., None, None] * S + jnp.einsum("BJKGH,BKGJM->BKGHM", kd, u)
        return S, o

    S, o = jax.lax.scan(body, S0, tuple(a.swapaxes(0, 1) for a in (U, W, P, qd, kd, dend)))
    o = o.swapaxes(0, 1).reshape(B, n * c, N, M)[:, :T]
    return o, S.reshape(B, N, H, M)


class GatedDeltaNet(RecurrentMixer):
    """`[B, T, D] -> [B, T, D]` Gated DeltaNet mixer (a drop-in for attention in a block)."""

    def __init__(self, d_model: int, gdn: GatedDeltaNetConfig, *, norm_eps: float = 1e-6,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        """`gdn` (`tfjax.config.GatedDeltaNetConfig`): the heads, head dims, conv width and
        chunk. Here num_v_heads 0 -> num_k_heads, head_v_dim 0 -> head_k_dim and chunk
        0 -> the sequential recurrence (`gated_delta_rule_reference`) instead of the
        chunked form; num_k_heads and head_k_dim must be set (their 0, "the model's",
        is resolved by the layer kind: `gdn.resolved(num_heads, head_dim)`)."""
        num_k_heads, head_k_dim, d_conv, chunk_size = (gdn.num_k_heads, gdn.head_k_dim,
                                                       gdn.d_conv, gdn.chunk)
        Hv, dv = gdn.num_v_heads or num_k_heads, gdn.head_v_dim or head_k_dim
        for name, val in (("d_model", d_model), ("num_k_heads", num_k_heads), ("num_v_heads", Hv),
                          ("head_k_dim", head_k_dim), ("head_v_dim", dv), ("d_conv", d_conv)):
            if val < 1:
                derive = (" (0 is model.gdn's 'the model's': pass gdn.resolved(num_heads, "
                          "head_dim))" if name in ("num_k_heads", "head_k_dim") else "")
                raise ValueError(f"{name} must be >= 1, got {val}{derive}")
        if chunk_size < 0:
            raise ValueError(f"chunk must be >= 0 (0: sequential), got {chunk_size}")
        if Hv % num_k_heads:
            raise ValueError(f"num_v_heads={Hv} must be a multiple of num_k_heads={num_k_heads}")
        D, Hk, dk = d_model, num_k_heads, head_k_dim
        self.d_model, self.num_k_heads, self.num_v_heads = D, Hk, Hv
        self.head_k_dim, self.head_v_dim, self.d_conv = dk, dv, d_conv
        self.chunk_size, self.dtype = chunk_size, dtype
        normal = nnx.initializers.normal(init_std)

        def param(init, shape, names):
            return nnx.Param(with_logical_axes(init, names)(rngs.params(), shape, param_dtype))

        def uniform(lo, hi):
            return lambda key, shape, dt=jnp.float32: jax.random.uniform(key, shape, dt, lo, hi)

        self.q_proj = param(normal, (D, Hk, dk), ("embed", "kv_heads", "head_dim"))
        self.k_proj = param(normal, (D, Hk, dk), ("embed", "kv_heads", "head_dim"))
        self.v_proj = param(normal, (D, Hv, dv), ("embed", "heads", "head_dim"))
        self.z_proj = param(normal, (D, Hv, dv), ("embed", "heads", "head_dim"))
        self.b_proj = param(normal, (D, Hv), ("embed", "heads"))
        self.a_proj = param(normal, (D, Hv), ("embed", "heads"))
        bound = d_conv ** -0.5
        qk_conv = (None, "kv_heads", "head_dim")
        self.conv_q = param(uniform(-bound, bound), (d_conv, Hk, dk), qk_conv)
        self.conv_k = param(uniform(-bound, bound), (d_conv, Hk, dk), qk_conv)
        self.conv_v = param(uniform(-bound, bound), (d_conv, Hv, dv), (None, "heads", "head_dim"))
        # A uniform in [1, 16] (fla's A_init_range), A_log = log A.
        self.A_log = param(lambda key, shape, dt=jnp.float32: jnp.log(
            jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dt), (Hv,), ("heads",))
        self.dt_bias = param(dt_bias_init(dt_min, dt_max, dt_init_floor), (Hv,), ("heads",))
        self.norm = make_norm("rmsnorm", dv, eps=norm_eps, dtype=jnp.float32,
                              param_dtype=param_dtype, rngs=rngs)
        out_std = init_std if out_init_std is None else out_init_std
        self.out_proj = param(nnx.initializers.normal(out_std), (Hv, dv, D),
                              ("heads", "head_dim", "embed"))

    # -- pieces -------------------------------------------------------------------
    def _in(self, x):
        """x `[..., D]` -> q, k `[..., Hk, dk]`, v, z `[..., Hv, dv]`, b, a `[..., Hv]`."""
        x = x.astype(self.dtype)

        def proj(w, spec):
            return jnp.einsum(spec, x, w[...].astype(self.dtype))

        heads = "...D,DNH->...NH"
        return (proj(self.q_proj, heads), proj(self.k_proj, heads), proj(self.v_proj, heads),
                proj(self.z_proj, heads), proj(self.b_proj, "...D,DN->...N"),
                proj(self.a_proj, "...D,DN->...N"))

    def _qk(self, q, k):
        """L2-normalised per head (float32); q also scaled by 1/sqrt(dk)."""
        q = l2_normalize(q.astype(jnp.float32)) * self.head_k_dim ** -0.5
        return q, l2_normalize(k.astype(jnp.float32))

    def _gates(self, b, a):
        """-> g (log decay) and beta `[..., Hv]` in float32."""
        a = a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        return g, jax.nn.sigmoid(b.astype(jnp.float32))

    def _out(self, o, z):
        """o `[..., Hv, dv]` (float32) -> norm(o) * silu(z) -> out_proj -> `[..., D]`."""
        y = (self.norm(o) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)
        return jnp.einsum("...NM,NMD->...D", y, self.out_proj[...].astype(self.dtype))

    def init_state(self, batch: int, size: int = 0, dtype: DType = jnp.float32, *,
                   window: int = 0) -> GatedDeltaNetState:
        """The empty state (`size` and `window`, a position-indexed state's geometry in
        the mixers' shared protocol, do not apply: it is O(1))."""
        W, Hk, Hv, dk, dv = (self.d_conv, self.num_k_heads, self.num_v_heads, self.head_k_dim,
                             self.head_v_dim)
        return GatedDeltaNetState(conv_q=jnp.zeros((batch, W - 1, Hk, dk), dtype),
                                  conv_k=jnp.zeros((batch, W - 1, Hk, dk), dtype),
                                  conv_v=jnp.zeros((batch, W - 1, Hv, dv), dtype),
                                  S=jnp.zeros((batch, Hv, dk, dv), jnp.float32))

    # -- sequence and step ----------------------------------------------------------
    def forward(self, x, state: GatedDeltaNetState | None = None, *, positions=None,
                lengths=None):
        """x `[B,T,D]` from `state` (None: empty) -> (y `[B,T,D]`, final state).

        `positions [B,T]`: a step at position 0 starts a new document (no conv input
        or state carried into it). `lengths [B]`: row b has lengths[b] real steps, then
        right padding; the final state is the state after its last real step."""
        B, T, _ = x.shape
        state = self.init_state(B, dtype=self.dtype) if state is None else state
        q, k, v, z, b, a = self._in(x)
        q, k = shard(q, QK_AXES), shard(k, QK_AXES)
        v, z = shard(v, V_AXES), shard(z, V_AXES)
        convs = [causal_conv(t, window, w[...], positions)
                 for t, window, w in ((q, state.conv_q, self.conv_q),
                                      (k, state.conv_k, self.conv_k),
                                      (v, state.conv_v, self.conv_v))]
        (q, qpad), (k, kpad), (v, vpad) = [(jax.nn.silu(y), pad) for y, pad in convs]
        q, k = self._qk(q, k)
        g, beta = self._gates(b, a)
        reset = None if positions is None else positions == 0
        if lengths is not None:  # padding: no write (beta = 0), no decay (g = 0), no reset
            valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
            g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
            reset = None if reset is None else reset & valid
        if self.chunk_size:
            o, S = gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, state=state.S,
                                    reset=reset)
        else:
            o, S = gated_delta_rule_reference(q, k, v, g, beta, state=state.S, reset=reset)
        o, S = hook("hook_ssm_out", o), hook("hook_state", S)  # [B,T,Hv,dv], [B,Hv,dk,dv] fp32
        W = self.d_conv
        new = GatedDeltaNetState(
            conv_q=last_conv_inputs(qpad, lengths, W).astype(state.conv_q.dtype),
            conv_k=last_conv_inputs(kpad, lengths, W).astype(state.conv_k.dtype),
            conv_v=last_conv_inputs(vpad, lengths, W).astype(state.conv_v.dtype), S=S)
        return self._out(o, z), new

    def step(self, x_t, state: GatedDeltaNetState):
        """One token: x_t `[B, D]` -> (y_t `[B, D]`, new state). O(1) in the length."""
        B = x_t.shape[0]
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q, k, v, z, b, a = self._in(x_t)

        def conv(t, window, w):
            win = jnp.concatenate([window.astype(t.dtype), t[:, None]], axis=1)  # [B, W, ...]
            return jax.nn.silu(jnp.einsum("BW...,W...->B...", win, w[...].astype(t.dtype))), win

        (q, wq), (k, wk), (v, wv) = (conv(q, state.conv_q, self.conv_q),
                                     conv(k, state.conv_k, self.conv_k),
                                     conv(v, state.conv_v, self.conv_v))
        q, k = self._qk(q, k)
        g, beta = self._gates(b, a)
        G = Hv // Hk
        o, S = gated_delta_step(q, k, v.astype(jnp.float32).reshape(B, Hk, G, dv),
                                jnp.exp(g).reshape(B, Hk, G), beta.reshape(B, Hk, G),
                                state.S.astype(jnp.float32).reshape(B, Hk, G, dk, dv))
        new = GatedDeltaNetState(conv_q=wq[:, 1:].astype(state.conv_q.dtype),
                                 conv_k=wk[:, 1:].astype(state.conv_k.dtype),
                                 conv_v=wv[:, 1:].astype(state.conv_v.dtype),
                                 S=S.reshape(B, Hv, dk, dv))
        return self._out(o.reshape(B, Hv, dv), z), new

