"""Mamba-2: the state-space-duality (SSD) layer (Dao & Gu 2024, arXiv:2405.21060), one
scalar decay per head: `h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T`, `y_t = h_t C_t +
D x_t`, h `[H, P, N]`, B and C shared by the heads of each of G groups.

`Mamba2(d_model, mamba2)`: `x [B, T, D] -> [B, T, D]`, trained with SSD's chunked
algorithm `ssd` (float32; its ground truth `ssd_reference`), layout and numerics as
mamba_ssm's / Hugging Face's `Mamba2Mixer`. Decoding is O(1) per token: `init_state`
gives a `Mamba2State`, `step(u_t, state)` advances one token and `forward(u, state,
positions=, lengths=)` a prompt; packed documents and right padding never mix into
the state. See docs/layers.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tfjax.config import Mamba2Config
from tfjax.nn.hooks import hook
from tfjax.nn.ssm import SelectiveSSM, causal_conv, dt_bias_init, last_conv_inputs
from tfjax.nn.state import DecodeState, decode_state
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import DType

__all__ = ["Mamba2", "Mamba2State", "ssd", "ssd_reference"]


@decode_state
class Mamba2State(DecodeState):
    """Decoding state of one Mamba-2 layer: conv `[B, d_conv - 1, Di + 2GN]` (the last
    conv inputs of x, B and C), ssm `[B, H, P, N]` (float32). O(1) in the length."""

    conv: jax.Array
    ssm: jax.Array
    AXES = {"conv": ("batch", None, None), "ssm": ("batch", "heads", None, None)}


def _f32(*arrays):
    return tuple(a.astype(jnp.float32) for a in arrays)


def ssd(x, dt, A, Bm, Cm, Dskip, h0=None, *, chunk_size: int = 64, reset=None):
    """y_t = h_t C_t + D x_t with h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, chunked.

    x `[B,T,H,P]`; dt `[B,T,H]` (>= 0); A `[H]` (negative); Bm, Cm `[B,T,G,N]` (H %
    G == 0); Dskip `[H]`; h0 `[B,H,P,N]` or None; reset `[B,T]` bool or None (the
    state is zeroed before that step). Returns y `[B,T,H,P]`, h_T `[B,H,P,N]`, float32.

    For its gradient it keeps only its inputs and the state entering each chunk
    (`[B, T/c, H, P, N]`): the within-chunk decay matrices and products (`[B, T, c,
    H]` each) are recomputed in the backward pass (`jax.checkpoint`), as mamba_ssm's
    kernels do, instead of being saved per layer.
    """
    return _ssd_checkpointed(x, dt, A, Bm, Cm, Dskip, h0, reset, chunk_size)


@functools.partial(jax.checkpoint, static_argnums=(8,),
                   policy=jax.checkpoint_policies.save_only_these_names("ssd_chunk_states"))
def _ssd_checkpointed(x, dt, A, Bm, Cm, Dskip, h0, reset, chunk_size):
    x, dt, A, Bm, Cm = _f32(x, dt, A, Bm, Cm)
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[-2:]
    R = H // G  # heads per group
    h0 = jnp.zeros((Bsz, H, P, N), jnp.float32) if h0 is None else h0.astype(jnp.float32)
    c = max(1, min(chunk_size, T))
    pad = (-T) % c  # dt = 0 on padding: decay exp(0) = 1 and no input

    def chunks(a, fill=0):  # [B, T, ...] -> [B, nc, c, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return a.reshape(Bsz, -1, c, *a.shape[2:])

    xdt = chunks((x * dt[..., None]).reshape(Bsz, T, G, R, P))  # [B, nc, c, G, R, P]
    Bc, Cc = chunks(Bm), chunks(Cm)  # [B, nc, c, G, N]
    cum = jnp.cumsum(chunks(dt * A), axis=2).reshape(*xdt.shape[:3], G, R)  # [B,nc,c,G,R]
    last = cum[:, :, -1:]  # [B, nc, 1, G, R]
    ones = jnp.ones(xdt.shape[:3], bool)
    if reset is None:  # same segment: no reset in (s, l]; first: no reset in [0, l]
        seg = None
        first, to_end = ones, ones
    else:
        seg = jnp.cumsum(chunks(reset, False).astype(jnp.int32), axis=2)  # [B, nc, c]
        first, to_end = seg == 0, seg == seg[:, :, -1:]
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = causal if seg is None else causal & (seg[..., :, None] == seg[..., None, :])

    def decay(exponent, keep):  # exp where kept, exactly 0 elsewhere (no inf * 0 in grads)
        return jnp.exp(jnp.where(keep, exponent, -jnp.inf))

    # 1. Within chunks: the quadratic (attention-like) form.
    L = decay(cum[:, :, :, None] - cum[:, :, None], same[..., None, None])  # [B,nc,l,s,G,R]
    CB = jnp.einsum("BZLGN,BZSGN->BZLSG", Cc, Bc)
    y = jnp.einsum("BZLSG,BZLSGR,BZSGRP->BZLGRP", CB, L, xdt)
    # 2. Each chunk's own contribution to its final state.
    w_end = decay(last - cum, to_end[..., None, None])  # [B, nc, c, G, R]
    states = jnp.einsum("BZSGN,BZSGR,BZSGRP->BZGRPN", Bc, w_end, xdt)
    carry = decay(last[:, :, 0], True if seg is None else (seg[:, :, -1] == 0)[..., None, None])

    # 3. Across chunks: h_in[z + 1] = carry[z] h_in[z] + states[z].
    def body(h, xs):
        a, s = xs
        return a[..., None, None] * h + s, h

    h, h_in = jax.lax.scan(body, h0.reshape(Bsz, G, R, P, N),
                           (carry.swapaxes(0, 1), states.swapaxes(0, 1)))
    h_in = checkpoint_name(h_in.swapaxes(0, 1), "ssd_chunk_states")  # [B,nc,G,R,P,N]: in
    # 4. The incoming state read out through C, decayed to each step.
    w_in = decay(cum, first[..., None, None])  # [B, nc, c, G, R]
    y = y + jnp.einsum("BZLGN,BZLGR,BZGRPN->BZLGRP", Cc, w_in, h_in)
    y = y.reshape(Bsz, -1, H, P)[:, :T]
    return y + Dskip.astype(jnp.float32)[:, None] * x, h.reshape(Bsz, H, P, N)


def ssd_reference(x, dt, A, Bm, Cm, Dskip, h0=None, reset=None):
    """The sequential recurrence (a `lax.scan` over T; ground truth for tests), same
    signature and results as `ssd`."""
    x, dt, A, Bm, Cm = _f32(x, dt, A, Bm, Cm)
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[-2:]
    h0 = jnp.zeros((Bsz, H, P, N), jnp.float32) if h0 is None else h0.astype(jnp.float32)
    Bh, Ch = (jnp.repeat(a, H // G, axis=2) for a in (Bm, Cm))  # [B, T, H, N]
    reset = jnp.zeros((Bsz, T), bool) if reset is None else reset

    def body(h, xs):
        x_t, dt_t, B_t, C_t, r_t = xs
        h = jnp.where(r_t[:, None, None, None], 0.0, h)
        h = (jnp.exp(dt_t * A)[..., None, None] * h
             + jnp.einsum("BHP,BHN->BHPN", x_t * dt_t[..., None], B_t))
        return h, jnp.einsum("BHPN,BHN->BHP", h, C_t)

    h, ys = jax.lax.scan(body, h0, tuple(a.swapaxes(0, 1) for a in (x, dt, Bh, Ch, reset)))
    return ys.swapaxes(0, 1) + Dskip.astype(jnp.float32)[:, None] * x, h


class Mamba2(SelectiveSSM):
    """`[B, T, D] -> [B, T, D]` SSD mixer (a drop-in for attention in a block).
    `mamba2` (`tfjax.config.Mamba2Config`): state size, head dim, expansion, groups,
    conv width, SSD chunk, biases, norm groups (0: n_groups), dt_bias init range and
    dt limits (dt_max_limit 0: none)."""

    def __init__(self, d_model: int, mamba2: Mamba2Config = Mamba2Config(), *,
                 norm_eps: float = 1e-5, dt_init_floor: float = 1e-4,
                 A_init_range: tuple[float, float] = (1.0, 16.0),
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        m = mamba2
        d_state, head_dim, expand, n_groups = m.d_state, m.head_dim, m.expand, m.n_groups
        d_conv, chunk_size, norm_groups = m.d_conv, m.chunk, m.norm_groups
        dt_limit = (m.dt_min_limit, m.dt_max_limit or math.inf)
        for name, v in (("d_model", d_model), ("d_state", d_state), ("head_dim", head_dim),
                        ("expand", expand), ("n_groups", n_groups), ("d_conv", d_conv),
                        ("chunk_size", chunk_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        D, Di, N, G = d_model, expand * d_model, d_state, n_groups
        if Di % head_dim:
            raise ValueError(f"head_dim={head_dim} must divide the inner width expand * d_model "
                             f"= {Di}")
        H = Di // head_dim
        if H % G:
            raise ValueError(f"n_groups={G} must divide the number of heads {H} (= expand * "
                             f"d_model / head_dim)")
        norm_groups = norm_groups or G
        if Di % norm_groups:
            raise ValueError(f"norm_groups={norm_groups} must divide the inner width {Di}")
        self.d_model, self.d_inner, self.d_state, self.d_conv = D, Di, N, d_conv
        self.num_heads, self.head_dim, self.n_groups, self.norm_groups = H, head_dim, G, norm_groups
        self.conv_dim = Di + 2 * G * N
        self.chunk_size, self.norm_eps, self.dtype = chunk_size, norm_eps, dtype
        self.dt_limit = tuple(float(v) for v in dt_limit)
        normal = nnx.initializers.normal(init_std)
        zeros = nnx.initializers.zeros_init()

        def param(init, shape, names):
            return nnx.Param(with_logical_axes(init, names)(rngs.params(), shape, param_dtype))

        def uniform(lo, hi):
            return lambda key, shape, dt=jnp.float32: jax.random.uniform(key, shape, dt, lo, hi)

        width = 2 * Di + 2 * G * N + H  # z, x, B, C, dt
        self.in_proj = param(normal, (D, width), ("embed", None))
        self.in_bias = param(zeros, (width,), (None,)) if m.proj_bias else None
        bound = d_conv ** -0.5
        self.conv_w = param(uniform(-bound, bound), (d_conv, self.conv_dim), (None, None))
        self.conv_b = param(zeros, (self.conv_dim,), (None,)) if m.conv_bias else None
        self.dt_bias = param(dt_bias_init(m.dt_min, m.dt_max, dt_init_floor), (H,), ("heads",))
        a_lo, a_hi = A_init_range
        self.A_log = param(lambda key, shape, dt=jnp.float32: jnp.log(
            jax.random.uniform(key, shape, jnp.float32, a_lo, a_hi)).astype(dt), (H,), ("heads",))
        self.D = param(nnx.initializers.ones_init(), (H,), ("heads",))
        self.norm_w = param(nnx.initializers.ones_init(), (Di,), ("mlp",))
        out_std = init_std if out_init_std is None else out_init_std
        self.out_proj = param(nnx.initializers.normal(out_std), (Di, D), ("mlp", "embed"))
        self.out_bias = param(zeros, (D,), ("embed",)) if m.proj_bias else None

    # -- pieces -------------------------------------------------------------------
    def _in(self, u):
        """u `[..., D]` -> z `[..., Di]`, xBC `[..., Di + 2GN]`, dt (raw) `[..., H]`."""
        p = jnp.einsum("...D,DW->...W", u.astype(self.dtype), self.in_proj[...].astype(self.dtype))
        if self.in_bias is not None:
            p = p + self.in_bias[...].astype(self.dtype)
        Di = self.d_inner
        return p[..., :Di], p[..., Di:Di + self.conv_dim], p[..., Di + self.conv_dim:]

    def _split(self, xBC, dt):
        """Conv output `[..., Di + 2GN]` and raw dt `[..., H]` -> x `[..., H, P]`, B, C
        `[..., G, N]`, dt `[..., H]` (softplus, clipped), all float32."""
        Di, G, N = self.d_inner, self.n_groups, self.d_state
        xBC = xBC.astype(jnp.float32)
        x = xBC[..., :Di].reshape(*xBC.shape[:-1], self.num_heads, self.head_dim)
        Bm = xBC[..., Di:Di + G * N].reshape(*xBC.shape[:-1], G, N)
        Cm = xBC[..., Di + G * N:].reshape(*xBC.shape[:-1], G, N)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        lo, hi = self.dt_limit
        if lo > 0.0 or hi < math.inf:
            dt = jnp.clip(dt, lo, hi)
        return x, Bm, Cm, dt

    def _out(self, y, z):
        """y `[..., H, P]` (float32), z `[..., Di]` -> `[..., D]`: the gated RMSNorm
        (norm(y * silu(z)) over groups of Di / norm_groups), then out_proj."""
        y = y.reshape(*y.shape[:-2], self.d_inner) * jax.nn.silu(z.astype(jnp.float32))
        g = y.reshape(*y.shape[:-1], self.norm_groups, -1)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.norm_eps)
        y = (g.reshape(y.shape) * self.norm_w[...].astype(jnp.float32)).astype(self.dtype)
        return self._project_out(y)

    def init_state(self, batch: int, size: int = 0, dtype: DType = jnp.float32, *,
                   window: int = 0) -> Mamba2State:
        """The empty state (`size` and `window`, a position-indexed state's geometry in
        the mixers' shared protocol, do not apply: it is O(1))."""
        return Mamba2State(
            conv=jnp.zeros((batch, self.d_conv - 1, self.conv_dim), dtype),
            ssm=jnp.zeros((batch, self.num_heads, self.head_dim, self.d_state), jnp.float32))

    # -- sequence and step ----------------------------------------------------------
    def forward(self, u, state: Mamba2State | None = None, *, positions=None, lengths=None):
        """u `[B,T,D]` from `state` (None: empty) -> (y `[B,T,D]`, final `Mamba2State`).

        `positions [B,T]`: a step at position 0 starts a new document (no conv or
        state carried into it). `lengths [B]`: row b has lengths[b] real steps, then
        right padding; the final state is the state after its last real step."""
        Bsz, T, _ = u.shape
        K = self.d_conv
        state = self.init_state(Bsz, dtype=self.dtype) if state is None else state
        z, xBC, dt = self._in(u)
        z = shard(z, ("batch", "length", "mlp"))
        xc, xpad = causal_conv(xBC, state.conv, self.conv_w[...], positions,
                               None if self.conv_b is None else self.conv_b[...])
        x, Bm, Cm, dt = self._split(jax.nn.silu(xc), dt)
        x = hook("hook_ssm_input", shard(x, ("batch", "length", "heads", None)))  # [B,T,H,P]
        if lengths is not None:  # dt = 0 on padding: decay 1 and no input
            valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
            dt = jnp.where(valid[..., None], dt, 0.0)
        reset = None if positions is None else positions == 0
        y, h = ssd(x, dt, self._A(), Bm, Cm, self.D[...], state.ssm,
                   chunk_size=self.chunk_size, reset=reset)
        y, h = hook("hook_ssm_out", y), hook("hook_state", h)  # [B,T,H,P], [B,H,P,N] fp32
        conv = last_conv_inputs(xpad, lengths, K)  # up to each row's last real step
        return self._out(y, z), Mamba2State(conv=conv.astype(state.conv.dtype), ssm=h)

    def step(self, u_t, state: Mamba2State):
        """One token: u_t `[B, D]` -> (y_t `[B, D]`, new state). O(1) in the length."""
        z, xBC, dt = self._in(u_t)
        window = jnp.concatenate([state.conv.astype(xBC.dtype), xBC[:, None]], axis=1)  # [B,K,C]
        xc = jnp.einsum("BKC,KC->BC", window, self.conv_w[...].astype(xBC.dtype))
        if self.conv_b is not None:
            xc = xc + self.conv_b[...].astype(xc.dtype)
        x, Bm, Cm, dt = self._split(jax.nn.silu(xc), dt)  # x [B,H,P], B, C [B,G,N], dt [B,H]
        R = self.num_heads // self.n_groups
        Bh, Ch = jnp.repeat(Bm, R, axis=1), jnp.repeat(Cm, R, axis=1)  # [B, H, N]
        h = (jnp.exp(dt * self._A())[..., None, None] * state.ssm
             + jnp.einsum("BHP,BHN->BHPN", x * dt[..., None], Bh))
        y = jnp.einsum("BHPN,BHN->BHP", h, Ch) + self.D[...].astype(jnp.float32)[:, None] * x
        return self._out(y, z), Mamba2State(conv=window[:, 1:].astype(state.conv.dtype), ssm=h)

