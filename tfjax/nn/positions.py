"""Position encodings: sinusoidal, learned, rotary (with context-extension scalings),
ALiBi and T5 relative bias.

`POSITIONS` names where each acts ("embedding", "rotary", "bias"); `ROPE_SCALINGS`
holds RoPE's scalings (linear, ntk, dynamic_ntk, yarn, llama3, longrope).
`RotaryEmbedding(head_dim, rope)` is a frozen dataclass without parameters:
`tables(positions [B, T])`, then `rotate(x [B, T, N, H], tables)`, in float32. Biases
(`alibi_bias`, `T5RelativeBias`) come from explicit q/kv positions, so packed rows,
caches and ring shards get the right offsets. See docs/layers.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from tfjax.config import RopeConfig, T5Config
from tfjax.ops.reference import RelativeBias, relative_position_bucket
from tfjax.ops.reference import check_buckets as _check_buckets
from tfjax.parallel.sharding import with_logical_axes
from tfjax.registry import Registry

__all__ = [
    "POSITIONS",
    "ROPE_SCALINGS",
    "LearnedPositions",
    "RotaryEmbedding",
    "T5RelativeBias",
    "alibi_bias",
    "default_positions",
    "alibi_slopes",
    "relative_position_bucket",
    "sinusoidal_embedding",
]


def default_positions(x: jax.Array) -> jax.Array:
    """`[B, T]` int32 positions 0..T-1 of every row of `x` `[B, T, ...]`."""
    B, T = x.shape[:2]
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

# Name -> where the encoding acts: "none" | "embedding" | "rotary" | "bias".
POSITIONS: Registry[str] = Registry("position")
POSITIONS.register("none", "none")
POSITIONS.register("sinusoidal", "embedding")
POSITIONS.register("learned", "embedding")
POSITIONS.register("rope", "rotary")
POSITIONS.register("alibi", "bias")
POSITIONS.register("t5", "bias")

# Name -> fn(rope: RopeConfig, rotary_dim, seq_len) -> inv_freq [rotary_dim // 2] (float32).
ROPE_SCALINGS: Registry[Callable[[RopeConfig, int, jax.Array | int | None], jax.Array]] = (
    Registry("rope scaling"))

ROPE_LAYOUTS = ("half", "interleaved")


# ----------------------------------------------------------------------------- sinusoidal


def sinusoidal_embedding(
    positions: Int[Array, "B T"],
    dim: int,
    *,
    max_timescale: float = 10000.0,
    dtype=jnp.float32,
) -> Float[Array, "B T D"]:
    """PE(pos, 2i) = sin(pos / max_timescale^(2i/dim)), PE(pos, 2i+1) = cos(same).

    Interleaved as the paper writes it (tensor2tensor concatenates [sin, cos] instead).
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim must be a positive even number (sin/cos pairs), got {dim}")
    # Angles in float32 whatever `dtype` is: pos / timescale needs the mantissa.
    exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim  # [D/2] = 2i/d
    inv_timescale = 1.0 / (max_timescale ** exponent)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_timescale  # [B, T, D/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [B, T, D/2, 2]
    return pe.reshape(*angles.shape[:-1], dim).astype(dtype)


# ----------------------------------------------------------------------------- learned


class LearnedPositions(nnx.Module):
    """A trained table of absolute position embeddings, [max_len, D]."""

    def __init__(
        self,
        max_len: int,
        dim: int,
        *,
        init_std: float = 0.02,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.max_len = max_len
        self.dim = dim
        init = with_logical_axes(nnx.initializers.normal(init_std), ("max_len", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (max_len, dim), param_dtype))

    def __call__(self, positions: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        if positions.shape[-1] > self.max_len:
            raise ValueError(
                f"sequence length {positions.shape[-1]} exceeds max_len={self.max_len} of the "
                "learned position table; raise max_len or use a relative encoding")
        # mode="fill": a traced position >= max_len gives NaN instead of silently
        # reusing the last row (which is what clipping gathers would do).
        return jnp.take(self.embedding[...], positions, axis=0, mode="fill")


# ----------------------------------------------------------------------------- rotary


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    """Rotary position embedding of the first `rotary_dim` dims of each head, as `rope`
    (a `tfjax.config.RopeConfig`, taken whole) says: its base `theta`, `fraction`,
    `layout` ("half" pairs (x[i], x[i + r/2]): GPT-NeoX, Llama, HF; "interleaved" pairs
    (x[2i], x[2i+1]): GPT-J, the paper) and `scaling`, an entry of ROPE_SCALINGS, with
    that scaling's fields (the context-extension factor s, the pre-training context
    `original_max_len`, YaRN's beta_fast / beta_slow / mscale / truncate, llama3's
    low / high_freq_factor, longrope's short / long_factor). The config's fields are
    checked here too, as the ones this embedding uses (an error names the field)."""

    head_dim: int
    rope: RopeConfig = RopeConfig()

    def __post_init__(self):
        r = self.rope
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if not r.theta > 0:
            raise ValueError(f"theta must be positive, got {r.theta}")
        if not 0.0 < r.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {r.fraction}")
        rotary = r.fraction * self.head_dim
        # round(), not int(): 0.29 * 100 == 28.999999999999996 must mean 29 (then rejected
        # as odd), not a silent 28.
        if abs(rotary - round(rotary)) > 1e-6 or round(rotary) % 2 or round(rotary) == 0:
            raise ValueError(
                f"fraction: rotary dims = fraction * head_dim = {r.fraction} * {self.head_dim}"
                f" = {rotary:g} must be a positive even integer")
        if r.layout not in ROPE_LAYOUTS:
            raise ValueError(f"unknown layout={r.layout!r}; allowed: {', '.join(ROPE_LAYOUTS)}")
        ROPE_SCALINGS.get(r.scaling, field="scaling")
        if not r.factor >= 1.0:
            raise ValueError(
                f"factor must be >= 1 (the context extension factor), got {r.factor}")
        if r.original_max_len <= 0:
            raise ValueError(f"original_max_len must be positive, got {r.original_max_len}")
        if r.scaling in ("ntk", "dynamic_ntk") and self.rotary_dim <= 2:
            # The NTK exponent d / (d - 2) is undefined for a single rotated pair.
            raise ValueError(f"fraction: scaling={r.scaling!r} needs rotary dims > 2, "
                             f"got {self.rotary_dim}")
        if r.scaling == "yarn" and not r.beta_fast > r.beta_slow > 0:
            raise ValueError(f"beta_fast must be > beta_slow > 0 for yarn, got "
                             f"beta_fast={r.beta_fast}, beta_slow={r.beta_slow}")
        if r.scaling == "longrope" and not (
                len(r.short_factor) == len(r.long_factor) == self.rotary_dim // 2):
            raise ValueError(f"short_factor and long_factor: longrope needs rotary_dim / 2 = "
                             f"{self.rotary_dim // 2} factors each, got "
                             f"{len(r.short_factor)} and {len(r.long_factor)}")
        if r.scaling == "llama3" and not r.high_freq_factor >= r.low_freq_factor > 0:
            raise ValueError(f"high_freq_factor must be >= low_freq_factor > 0 for llama3, got "
                             f"high_freq_factor={r.high_freq_factor}, "
                             f"low_freq_factor={r.low_freq_factor}")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.rope.fraction * self.head_dim))

    @property
    def attention_factor(self) -> float:
        """Multiplier on cos and sin: YaRN's temperature 0.1 * mscale * ln(s) + 1,
        LongRoPE's sqrt(1 + ln(s) / ln(original_max_len)), else 1."""
        r = self.rope
        if r.scaling == "yarn" and r.factor > 1.0:
            return 0.1 * r.mscale * math.log(r.factor) + 1.0
        if r.scaling == "longrope" and r.factor > 1.0:
            return math.sqrt(1.0 + math.log(r.factor) / math.log(r.original_max_len))
        return 1.0

    def inv_freq(self, seq_len: jax.Array | int | None = None) -> Float[Array, " R"]:
        """Angular frequency of each rotated pair, [rotary_dim // 2], float32.

        `seq_len` (may be traced) is the current length, used only by dynamic_ntk and
        longrope.
        """
        return ROPE_SCALINGS.get(self.rope.scaling, field="scaling")(self.rope, self.rotary_dim,
                                                                     seq_len)

    def __call__(
        self, x: Float[Array, "B T N H"], positions: Int[Array, "B T"]
    ) -> Float[Array, "B T N H"]:
        """x rotated by the angles of `positions`: `rotate(x, tables(positions))`."""
        if positions.ndim != x.ndim - 2:
            raise ValueError(f"positions must be [B, T] for x [B, T, N, H]; got positions "
                             f"{positions.shape} and x {x.shape}")
        return self.rotate(x, self.tables(positions))

    def tables(self, positions: Int[Array, "B T"]) -> tuple[Array, Array]:
        """(cos, sin) `[B, T, 1, R/2]` float32 of `positions` (times the attention factor).
        Computed once for several rotations (q and k; a layer stack's every layer:
        `LayerStack` passes them down as `rope_tables`), since XLA fuses them into each
        rotation and recomputes them per head (on CPU, a scalar libm call an element)."""
        # dynamic_ntk grows the base with the longest position in the batch, as HF does;
        # longrope picks its factors by it.
        seq_len = (jnp.max(positions) + 1 if self.rope.scaling in ("dynamic_ntk", "longrope")
                   else None)
        inv_freq = self.inv_freq(seq_len)  # [R/2]
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
        cos = (jnp.cos(angles) * self.attention_factor)[..., None, :]  # [B, T, 1, R/2]
        sin = (jnp.sin(angles) * self.attention_factor)[..., None, :]
        return cos, sin

    def rotate(self, x: Float[Array, "B T N H"], tables: tuple[Array, Array]
               ) -> Float[Array, "B T N H"]:
        """x `[B, T, N, H]` rotated by `tables(positions)`."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"head_dim={self.head_dim} but x has last dim {x.shape[-1]} "
                             f"(x.shape={x.shape}, expected [B, T, N, H])")
        cos, sin = tables
        r = self.rotary_dim
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = self.rope.layout == "half"
        if half:
            x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
        else:
            pairs = x_rot.reshape(*x_rot.shape[:-1], r // 2, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        # (x1 + i x2) * e^{i angle}, each half cast back before they are joined (the
        # same values; the gradient's halves then stay in x's dtype too)
        y1 = (x1 * cos - x2 * sin).astype(x.dtype)
        y2 = (x2 * cos + x1 * sin).astype(x.dtype)
        if half:
            y = jnp.concatenate([y1, y2], axis=-1)
        else:
            y = jnp.stack([y1, y2], axis=-1).reshape(x_rot.shape)
        return jnp.concatenate([y, x_pass], axis=-1)


def _inv_freq_from_base(base, dim: int) -> jax.Array:
    # 1 / base^(2i/d), i < d/2 -- the shared form, so scalings that change only the
    # base are bit-identical to plain RoPE when the base is unchanged.
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


@ROPE_SCALINGS.register("none")
def _rope_none(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    return _inv_freq_from_base(rope.theta, d)


@ROPE_SCALINGS.register("linear")
def _rope_linear(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    # Position interpolation: angle(p / s) == (p) * (inv_freq / s).
    return _inv_freq_from_base(rope.theta, d) / rope.factor


@ROPE_SCALINGS.register("ntk")
def _rope_ntk(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    # NTK-aware: stretch the base so the lowest frequency is interpolated by s while the
    # highest stays put: base' = base * s^(d / (d - 2)).
    return _inv_freq_from_base(rope.theta * rope.factor ** (d / (d - 2)), d)


@ROPE_SCALINGS.register("dynamic_ntk")
def _rope_dynamic_ntk(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    if seq_len is None:
        return _inv_freq_from_base(rope.theta, d)
    length = jnp.asarray(seq_len, jnp.float32)
    orig = float(rope.original_max_len)
    grown = rope.theta * ((rope.factor * length / orig) - (rope.factor - 1.0)) ** (d / (d - 2))
    # where, not a clamp of the length: exactly plain RoPE up to original_max_len.
    base = jnp.where(length > orig, grown, jnp.float32(rope.theta))
    return _inv_freq_from_base(base, d)


@ROPE_SCALINGS.register("longrope")
def _rope_longrope(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    plain = _inv_freq_from_base(rope.theta, d)
    short = jnp.asarray(rope.short_factor, jnp.float32)
    if seq_len is None:
        return plain / short
    longer = jnp.asarray(seq_len) > rope.original_max_len
    return plain / jnp.where(longer, jnp.asarray(rope.long_factor, jnp.float32), short)


@ROPE_SCALINGS.register("yarn")
def _rope_yarn(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    # NTK-by-parts: pairs that rotate more than beta_fast times over the original context
    # keep their frequency (extrapolate), those rotating fewer than beta_slow times are
    # interpolated by s, and a ramp blends between. The ramp is linear in the pair index
    # between floor/ceil of the band edges, as the authors' released code and HF do (the
    # paper's eq. writes it linear in the rotation count); checkpoints were trained so.
    # truncate=False keeps the fractional edges (gpt-oss; HF's rope_parameters.truncate).
    inv_freq = _inv_freq_from_base(rope.theta, d)

    def edge(num_rotations: float) -> float:
        # Pair index i (fractional) at which original_max_len / wavelength_i == num_rotations.
        return (d * math.log(rope.original_max_len / (num_rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = edge(rope.beta_fast), edge(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    # ramp 0 -> high frequency (keep), 1 -> low frequency (interpolate).
    return inv_freq * (1.0 - ramp) + (inv_freq / rope.factor) * ramp


@ROPE_SCALINGS.register("llama3")
def _rope_llama3(rope: RopeConfig, d: int, seq_len=None) -> jax.Array:
    # Wavelengths longer than original_max_len / low_freq_factor are interpolated by s,
    # shorter than original_max_len / high_freq_factor kept, and the band between blended
    # by the rotation count (no band when the two are equal: Llama 4 Scout's 1 / 1).
    inv_freq = _inv_freq_from_base(rope.theta, d)
    orig = float(rope.original_max_len)
    wavelen = 2 * math.pi / inv_freq
    lo, hi = rope.low_freq_factor, rope.high_freq_factor
    smooth = (orig / wavelen - lo) / ((hi - lo) or 1.0)  # rotations over the original context
    blended = (1.0 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    out = jnp.where(wavelen > orig / lo, inv_freq / rope.factor, inv_freq)
    is_medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
    return jnp.where(is_medium, blended, out)


# ----------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Per-head ALiBi slopes, [N] float32: 2^(-8/n), 2^(-16/n), ... for n a power of two.

    Other head counts take the slopes of the closest lower power of two, then every
    other slope of the next power of two (the paper's and BLOOM's recipe).
    """
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


def alibi_bias(
    q_positions: Int[Array, "B T"],
    kv_positions: Int[Array, "B S"],
    slopes: Float[Array, " N"],
) -> Float[Array, "B N T S"]:
    """-slope * |q - k|: the causal ALiBi bias on every key a causal query sees, and its
    symmetric extension for bidirectional attention."""
    q = jnp.asarray(q_positions, jnp.float32)[:, None, :, None]  # [B, 1, T, 1]
    k = jnp.asarray(kv_positions, jnp.float32)[:, None, None, :]  # [B, 1, 1, S]
    m = jnp.asarray(slopes, jnp.float32)[None, :, None, None]  # [1, N, 1, 1]
    return -m * jnp.abs(q - k)


# ----------------------------------------------------------------------------- T5


class T5RelativeBias(nnx.Module):
    """A learned scalar per (relative-position bucket, head), added to the logits;
    `t5` (a `tfjax.config.T5Config`): the buckets' number and their max distance."""

    def __init__(
        self,
        num_heads: int,
        t5: T5Config = T5Config(),
        *,
        bidirectional: bool,
        init_std: float = 0.02,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        _check_buckets(t5.num_buckets, t5.max_distance, bidirectional)
        self.num_heads = num_heads
        self.num_buckets = t5.num_buckets
        self.max_distance = t5.max_distance
        self.bidirectional = bidirectional
        init = with_logical_axes(nnx.initializers.normal(init_std), ("relpos_buckets", "heads"))
        self.embedding = nnx.Param(init(rngs.params(), (t5.num_buckets, num_heads), param_dtype))

    def __call__(
        self, q_positions: Int[Array, "B T"], kv_positions: Int[Array, "B S"]
    ) -> Float[Array, "B N T S"]:
        """The materialised bias `[B, N, T, S]`."""
        T, S = q_positions.shape[-1], kv_positions.shape[-1]
        return self.spec(q_positions, kv_positions).dense(T, S)

    def spec(self, q_positions: Int[Array, "B T"], kv_positions: Int[Array, "B S"]
             ) -> RelativeBias:
        """The bias as `dot_product_attention(relative_bias=...)` takes it: the
        table and the positions, evaluated per tile by the tiled implementations."""
        return RelativeBias(self.embedding[...], bidirectional=self.bidirectional,
                            max_distance=self.max_distance,
                            q_positions=jnp.asarray(q_positions, jnp.int32),
                            kv_positions=jnp.asarray(kv_positions, jnp.int32))
