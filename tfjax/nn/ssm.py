"""Mamba: the selective state-space layer (Gu & Dao 2023, arXiv:2312.00752),
`h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`, `y_t = C_t . h_t + D x_t`, with dt, B and
C computed from the input and a state h `[Di, N]`.

`Mamba(d_model, ssm)`: `x [B, T, D] -> [B, T, D]`, trained with a parallel (or
chunked) associative scan, `selective_scan`, in float32 (its ground truth
`selective_scan_reference`). Decoding is O(1) per token: `init_state` gives a
`MambaState`, `step(u_t, state)` advances one token and `forward(u, state)` a prompt;
packed documents (`positions`) never mix into the state. See docs/layers.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import SSMConfig
from tfjax.nn.hooks import hook
from tfjax.nn.norms import make_norm
from tfjax.nn.state import DecodeState, RecurrentMixer, decode_state
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import DType

__all__ = ["Mamba", "MambaState", "causal_conv", "dt_bias_init", "last_conv_inputs",
           "selective_scan", "selective_scan_reference"]


def causal_conv(x, window, w, positions=None, bias=None):
    """Depthwise causal conv of x `[B,T,...]` after `window` `[B,W-1,...]` (the inputs
    before it) with taps w `[W,...]` (+ bias), before any activation; taps do not read
    before a position-0 step when `positions` `[B,T]` is given (packed documents).
    -> (y `[B,T,...]`, the padded inputs `[B, W-1+T, ...]` for `last_conv_inputs`)."""
    T, W = x.shape[1], w.shape[0]
    xpad = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    y = jnp.zeros_like(x)
    for j in range(W):  # tap j reads x[t - (W-1-j)]
        tap = xpad[:, j:j + T] * w[j].astype(x.dtype)
        lag = W - 1 - j
        if positions is not None and lag > 0:
            tap = jnp.where((positions >= lag).reshape(*positions.shape, *(1,) * (x.ndim - 2)),
                            tap, 0)
        y = y + tap
    return (y if bias is None else y + bias.astype(y.dtype)), xpad


def last_conv_inputs(xpad, lengths, W):
    """The W-1 conv inputs before step `lengths` `[B]` of each row (None: the end),
    from `causal_conv`'s padded inputs: the next call's window."""
    if W == 1:
        return xpad[:, :0]
    B, T = xpad.shape[0], xpad.shape[1] - (W - 1)
    end = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    idx = end[:, None] + jnp.arange(W - 1, dtype=jnp.int32)[None, :]  # [B, W-1] into xpad
    return jnp.take_along_axis(xpad, idx.reshape(*idx.shape, *(1,) * (xpad.ndim - 2)), axis=1)


def dt_bias_init(dt_min: float, dt_max: float, floor: float):
    """Initializer of a dt bias: softplus(bias) log-uniform in [dt_min, dt_max], at least
    `floor` (Mamba's init, also Mamba-2's and Gated DeltaNet's)."""
    def init(key, shape, dt=jnp.float32):
        u = jax.random.uniform(key, shape, jnp.float32)
        step = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        step = jnp.maximum(step, floor)
        return (step + jnp.log(-jnp.expm1(-step))).astype(dt)

    return init


@decode_state
class MambaState(DecodeState):
    """Decoding state of one Mamba layer: conv `[B, d_conv - 1, Di]` (the last conv
    inputs), ssm `[B, Di, N]` (float32). O(1) in the length."""

    conv: jax.Array
    ssm: jax.Array
    AXES = {"conv": ("batch", None, "mlp"), "ssm": ("batch", "mlp", None)}


def _combine(left, right):
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def _scan_chunk(u, dt, A, Bm, Cm, h0, reset):
    """Associative scan over one chunk. u, dt `[B,c,Di]`, Bm, Cm `[B,c,N]`, h0 `[B,Di,N]`,
    reset `[B,c]` bool (state zeroed before that step) -> y `[B,c,Di]`, h_last."""
    dA = jnp.exp(dt[..., None] * A)  # [B, c, Di, N]
    if reset is not None:
        dA = jnp.where(reset[:, :, None, None], 0.0, dA)
    dBu = (dt * u)[..., None] * Bm[:, :, None, :]  # [B, c, Di, N]
    dBu = dBu.at[:, 0].add(dA[:, 0] * h0)
    _, hs = jax.lax.associative_scan(_combine, (dA, dBu), axis=1)
    y = jnp.einsum("BTIN,BTN->BTI", hs, Cm)
    return y, hs[:, -1]


def selective_scan(u, dt, A, Bm, Cm, Dskip, h0=None, *, chunk_size: int = 0, reset=None):
    """y_t = C_t . h_t + D u_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t (float32).

    u, dt `[B,T,Di]`; A `[Di,N]` (negative); Bm, Cm `[B,T,N]`; Dskip `[Di]`; h0
    `[B,Di,N]` or None; reset `[B,T]` bool or None. Returns y `[B,T,Di]`, h_T `[B,Di,N]`.
    `chunk_size=0`: one associative scan over T; else chunks of that many steps.
    """
    f32 = jnp.float32
    u, dt, Bm, Cm, A = (a.astype(f32) for a in (u, dt, Bm, Cm, A))
    Bsz, T, Di = u.shape
    N = A.shape[-1]
    h0 = jnp.zeros((Bsz, Di, N), f32) if h0 is None else h0.astype(f32)
    if not chunk_size or chunk_size >= T:
        y, h = _scan_chunk(u, dt, A, Bm, Cm, h0, reset)
        return y + Dskip.astype(f32) * u, h
    c = chunk_size
    pad = (-T) % c  # dt = 0 on padding: exp(0) = 1 and no input, so the state passes through
    def chunks(a, fill=0):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return a.reshape(Bsz, -1, c, *a.shape[2:]).swapaxes(0, 1)  # [nc, B, c, ...]

    xs = (chunks(u), chunks(dt), chunks(Bm), chunks(Cm),
          None if reset is None else chunks(reset, False))

    @jax.checkpoint
    def body(h, xs):
        uc, dtc, Bc, Cc, rc = xs
        y, h = _scan_chunk(uc, dtc, A, Bc, Cc, h, rc)
        return h, y

    h, ys = jax.lax.scan(body, h0, xs)
    y = ys.swapaxes(0, 1).reshape(Bsz, -1, Di)[:, :T]
    return y + Dskip.astype(f32) * u, h


def selective_scan_reference(u, dt, A, Bm, Cm, Dskip, h0=None, reset=None):
    """The sequential loop over T (ground truth for tests)."""
    f32 = jnp.float32
    u, dt, Bm, Cm, A = (a.astype(f32) for a in (u, dt, Bm, Cm, A))
    Bsz, T, Di = u.shape
    h = jnp.zeros((Bsz, Di, A.shape[-1]), f32) if h0 is None else h0.astype(f32)
    ys = []
    for t in range(T):
        if reset is not None:
            h = jnp.where(reset[:, t, None, None], 0.0, h)
        h = jnp.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        ys.append(jnp.einsum("BIN,BN->BI", h, Cm[:, t]) + Dskip.astype(f32) * u[:, t])
    return jnp.stack(ys, 1), h


class SelectiveSSM(RecurrentMixer):
    """What Mamba and Mamba-2 share: the decay `A = -exp(A_log)` and the output
    projection (`out_proj`, `out_bias`) of a subclass's parameters."""

    def _A(self):
        return -jnp.exp(self.A_log[...].astype(jnp.float32))

    def _project_out(self, y):
        """y `[..., Di]` in the compute dtype -> `[..., D]`."""
        out = jnp.einsum("...I,ID->...D", y, self.out_proj[...].astype(self.dtype))
        if self.out_bias is not None:
            out = out + self.out_bias[...].astype(self.dtype)
        return out


class Mamba(SelectiveSSM):
    """`[B, T, D] -> [B, T, D]` selective SSM mixer (a drop-in for attention in a block).
    `ssm` (`tfjax.config.SSMConfig`): state size, conv width, expansion, dt rank (0:
    ceil(D / 16)), scan chunk (0: one scan over T), biases and Jamba's inner norms."""

    def __init__(self, d_model: int, ssm: SSMConfig = SSMConfig(), *, norm_eps: float = 1e-6,
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dtype: DType = jnp.float32, param_dtype: DType = jnp.float32,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        d_state, d_conv, expand = ssm.d_state, ssm.d_conv, ssm.expand
        for name, v in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv),
                        ("expand", expand)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        D, Di, N = d_model, expand * d_model, d_state
        R = ssm.dt_rank or math.ceil(d_model / 16)
        self.d_model, self.d_inner, self.d_state, self.d_conv, self.dt_rank = D, Di, N, d_conv, R
        self.chunk_size, self.dtype = ssm.chunk, dtype
        normal = nnx.initializers.normal(init_std)
        zeros = nnx.initializers.zeros_init()

        def param(init, shape, names):
            return nnx.Param(with_logical_axes(init, names)(rngs.params(), shape, param_dtype))

        def uniform(bound):
            return lambda key, shape, dt=jnp.float32: jax.random.uniform(key, shape, dt, -bound, bound)

        self.in_proj = param(normal, (D, 2, Di), ("embed", None, "mlp"))
        self.in_bias = param(zeros, (2, Di), (None, "mlp")) if ssm.proj_bias else None
        self.conv_w = param(uniform(d_conv ** -0.5), (d_conv, Di), (None, "mlp"))
        self.conv_b = param(zeros, (Di,), ("mlp",)) if ssm.conv_bias else None
        self.x_proj = param(normal, (Di, R + 2 * N), ("mlp", None))
        self.dt_proj = param(uniform(R ** -0.5), (R, Di), (None, "mlp"))
        self.dt_bias = param(dt_bias_init(dt_min, dt_max, dt_init_floor), (Di,), ("mlp",))
        a_init = lambda key, shape, dt=jnp.float32: jnp.broadcast_to(
            jnp.log(jnp.arange(1, N + 1, dtype=jnp.float32)), shape).astype(dt)
        self.A_log = param(a_init, (Di, N), ("mlp", None))
        self.D = param(nnx.initializers.ones_init(), (Di,), ("mlp",))
        out_std = init_std if out_init_std is None else out_init_std
        self.out_proj = param(nnx.initializers.normal(out_std), (Di, D), ("mlp", "embed"))
        self.out_bias = param(zeros, (D,), ("embed",)) if ssm.proj_bias else None
        if ssm.inner_norm:
            def norm(n):
                return make_norm("rmsnorm", n, eps=norm_eps, dtype=jnp.float32,
                                 param_dtype=param_dtype, rngs=rngs)

            self.dt_norm, self.b_norm, self.c_norm = norm(R), norm(N), norm(N)
        else:
            self.dt_norm = self.b_norm = self.c_norm = None

    # -- pieces -------------------------------------------------------------------
    def _in(self, u):
        xz = jnp.einsum("...D,DCI->...CI", u.astype(self.dtype), self.in_proj[...].astype(self.dtype))
        if self.in_bias is not None:
            xz = xz + self.in_bias[...].astype(self.dtype)
        return xz[..., 0, :], xz[..., 1, :]

    def _ssm_inputs(self, xc):
        """xc `[..., Di]` -> dt `[..., Di]`, B, C `[..., N]`, in float32."""
        R, N = self.dt_rank, self.d_state
        dbc = jnp.einsum("...I,IR->...R", xc, self.x_proj[...].astype(xc.dtype)).astype(jnp.float32)
        dt, Bm, Cm = dbc[..., :R], dbc[..., R:R + N], dbc[..., R + N:]
        if self.dt_norm is not None:
            dt, Bm, Cm = self.dt_norm(dt), self.b_norm(Bm), self.c_norm(Cm)
        dt = jnp.einsum("...R,RI->...I", dt, self.dt_proj[...].astype(jnp.float32))
        dt = jax.nn.softplus(dt + self.dt_bias[...].astype(jnp.float32))
        return dt, Bm, Cm

    def _out(self, y, z):
        return self._project_out((y * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype))

    def init_state(self, batch: int, size: int = 0, dtype: DType = jnp.float32, *,
                   window: int = 0) -> MambaState:
        """The empty state (`size` and `window`, a position-indexed state's geometry in
        the mixers' shared protocol, do not apply: it is O(1))."""
        return MambaState(conv=jnp.zeros((batch, self.d_conv - 1, self.d_inner), dtype),
                          ssm=jnp.zeros((batch, self.d_inner, self.d_state), jnp.float32))

    # -- sequence and step ----------------------------------------------------------
    def forward(self, u, state: MambaState | None = None, *, positions=None, lengths=None):
        """u `[B,T,D]` from `state` (None: empty) -> (y `[B,T,D]`, final `MambaState`).

        `positions [B,T]`: a step at position 0 starts a new document (no conv or
        state carried into it). `lengths [B]`: row b has lengths[b] real steps, then
        right padding; the final state is the state after its last real step."""
        Bsz, T, _ = u.shape
        K = self.d_conv
        state = self.init_state(Bsz, dtype=self.dtype) if state is None else state
        x, z = self._in(u)  # [B, T, Di]
        x = shard(x, ("batch", "length", "mlp"))
        xc, xpad = causal_conv(x, state.conv, self.conv_w[...], positions,
                               None if self.conv_b is None else self.conv_b[...])
        xc = hook("hook_ssm_input", jax.nn.silu(xc))  # [B,T,Di] (tfjax.nn.hooks)
        dt, Bm, Cm = self._ssm_inputs(xc)
        if lengths is not None:  # dt = 0 on padding: exp(0 * A) = 1 and no input
            valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
            dt = jnp.where(valid[..., None], dt, 0.0)
        reset = None if positions is None else positions == 0
        y, h = selective_scan(xc, dt, self._A(), Bm, Cm, self.D[...], state.ssm,
                              chunk_size=self.chunk_size, reset=reset)
        y, h = hook("hook_ssm_out", y), hook("hook_state", h)  # [B,T,Di], [B,Di,N] fp32
        conv = last_conv_inputs(xpad, lengths, K)  # up to each row's last real step
        return self._out(y, z), MambaState(conv=conv.astype(state.conv.dtype), ssm=h)

    def step(self, u_t, state: MambaState):
        """One token: u_t `[B, D]` -> (y_t `[B, D]`, new state). O(1) in the length."""
        x, z = self._in(u_t)  # [B, Di]
        window = jnp.concatenate([state.conv.astype(x.dtype), x[:, None]], axis=1)  # [B, K, Di]
        xc = jnp.einsum("BKI,KI->BI", window, self.conv_w[...].astype(x.dtype))
        if self.conv_b is not None:
            xc = xc + self.conv_b[...].astype(x.dtype)
        xc = jax.nn.silu(xc)
        dt, Bm, Cm = self._ssm_inputs(xc)
        xf = xc.astype(jnp.float32)
        h = jnp.exp(dt[..., None] * self._A()) * state.ssm + (dt * xf)[..., None] * Bm[:, None, :]
        y = jnp.einsum("BIN,BN->BI", h, Cm) + self.D[...].astype(jnp.float32) * xf
        return self._out(y, z), MambaState(conv=window[:, 1:].astype(state.conv.dtype), ssm=h)

