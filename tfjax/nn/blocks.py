"""Transformer blocks: a mixer and an optional feed-forward, joined with residuals.

`TransformerBlock(attn=, ffn=, make_norm=, cross_attn=, placement=, parallel=,
mixer_input=)`: `x [B, T, D] -> [B, T, D]` (with `state=`: `(x, new_state)`).
Sequential or parallel (`BLOCKS`), with pre-, post-, sandwich or output norm
(`PLACEMENTS`; pre: `x = x + f(norm(x))`); `mixer_input` adds a shared block's use to
the mixer's input (Zamba2). Composed from built modules, it knows nothing of configs.
See docs/layers.md.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nn.hooks import hook, scope
from tfjax.nn.norms import hooked_norm
from tfjax.registry import Registry

__all__ = ["BLOCKS", "PLACEMENTS", "TransformerBlock"]

BLOCKS: Registry[str] = Registry("block")
BLOCKS.register("sequential", "attention then feed-forward, each with its own residual")
BLOCKS.register("parallel", "attention and feed-forward read the same input (PaLM, GPT-J, NeoX)")

PLACEMENTS = ("pre", "post", "sandwich", "output")  # model.norm_placement
# the hook name (TransformerLens's) of the norm before each sublayer
_NORM_HOOKS = {"attn": "ln1", "mlp": "ln2", "cross_attn": "ln_cross"}


def _scoped(name: str, f: Callable) -> Callable:
    """f with its hook points named under `name.` (`tfjax.nn.hooks`)."""
    def g(*args, **kwargs):
        with scope(name):
            return f(*args, **kwargs)

    return g


def _gated(f: Callable, gate: nnx.Param) -> Callable:
    """h -> tanh(gate) f(h): a tanh-gated sublayer."""
    def g(h):
        y = f(h)
        return (jnp.tanh(gate[...]) * y.astype(jnp.float32)).astype(y.dtype)

    return g


def _rows(f: Callable, rows) -> Callable:
    """h -> rows[..., None] f(h), `rows` `[B, T]` (None: f itself)."""
    if rows is None:
        return f
    return lambda h: (lambda y: (rows[..., None] * y).astype(y.dtype))(f(h))


class TransformerBlock(nnx.Module):
    """One layer. `make_norm()` builds a fresh norm (called once per norm needed).
    `first_norm_residual` (pre norm): at layer 0 (the `layer` its stack passes) the
    residual stream becomes `attn_norm(x)` too, `x <- n(x); x + attn(x)` (ModernBERT:
    its embedding norm, then a layer 0 without an attention norm).

    `mixer_input` (pre norm, sequential): a module g whose output joins the mixer's
    input inside its norm but not the residual, x + attn(norm(x + g(x))) (Zamba2: a
    use of a shared transformer block added to a Mamba-2 layer's input,
    `tfjax.nn.shared_block.SharedBlockUse`). It is called as `g(x, block=shared,
    embeddings=embeddings, mask=, bias=, positions=, state=, slots=)` with the `shared`
    and `embeddings` the block's call gets; its decode state is "shared".

    `mixer_context` (sequential, pre norm, no `cross_attn`): the mixer is a
    cross-attention, called as `attn(norm(x), context, bias=context_bias)` (its decode
    state, "attn", holds the context's K/V, so a later step passes no `context`);
    with neither `context` nor `context_bias` the block is the identity (a text-only
    input skips the layer, as Llama-3.2-Vision does). `gated` (sequential, pre norm):
    `x + tanh(a) attn(..)`, then `x + tanh(m) rows ffn(norm(x))`, the scalars `a`,
    `m` starting at 0 (Flamingo; MLlama), `rows` `[B, T]` the call's `context_rows`
    (0 where a token's row sees no image) or 1."""

    def __init__(self, *, attn: nnx.Module, ffn: nnx.Module | None, make_norm: Callable[[], nnx.Module],
                 cross_attn: nnx.Module | None = None, placement: str = "pre",
                 parallel: bool = False, parallel_shared_norm: bool = True,
                 first_norm_residual: bool = False, dropout_rate: float = 0.0,
                 mixer_input: nnx.Module | None = None, mixer_context: bool = False,
                 gated: bool = False, rngs: nnx.Rngs | None = None):
        if placement not in PLACEMENTS:
            raise ValueError(f"norm_placement={placement!r}; allowed: {', '.join(PLACEMENTS)}")
        if parallel and placement != "pre":
            raise ValueError(f"a parallel block needs norm_placement='pre', got {placement!r}")
        if parallel and cross_attn is not None:
            raise ValueError("a parallel block has no cross-attention; use block='sequential'")
        if first_norm_residual and (parallel or placement != "pre"):
            raise ValueError("first_norm_residual needs a sequential block with placement='pre'")
        if mixer_input is not None and (parallel or placement != "pre" or first_norm_residual):
            raise ValueError("mixer_input needs a sequential block with placement='pre' (it "
                             "joins the mixer's input inside the pre-norm)")
        if (mixer_context or gated) and (parallel or placement != "pre" or cross_attn is not None
                                         or first_norm_residual or mixer_input is not None):
            raise ValueError("mixer_context / gated need a sequential block with placement='pre' "
                             "and no other cross-attention, mixer_input or first_norm_residual")
        self.mixer_input = mixer_input
        self.mixer_context = mixer_context
        # tanh gates of the mixer's and the ffn's residuals, 0 at init: the layer starts
        # as the identity (Flamingo's gated xattn-dense; MLlama's cross-attention layers)
        self.attn_gate = nnx.Param(jnp.zeros((), jnp.float32)) if gated else None
        self.ffn_gate = nnx.Param(jnp.zeros((), jnp.float32)) if gated and ffn is not None else None
        self.placement, self.parallel = placement, parallel
        self.first_norm_residual = first_norm_residual
        self.attn, self.ffn, self.cross_attn = attn, ffn, cross_attn
        self.attn_norm = make_norm()
        self.ffn_norm = None if (parallel and parallel_shared_norm) or ffn is None else make_norm()
        self.cross_norm = make_norm() if cross_attn is not None else None
        sandwich = placement == "sandwich"
        self.post_attn_norm = make_norm() if sandwich else None
        self.post_ffn_norm = make_norm() if sandwich and ffn is not None else None
        self.post_cross_norm = make_norm() if sandwich and cross_attn is not None else None
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs) if dropout_rate > 0 else None

    def _drop(self, y):
        return y if self.dropout is None else self.dropout(y)

    def _sublayer(self, x, f, norm, post_norm, name):
        """x + f's contribution, as the placement says. `name` ("attn", "cross_attn",
        "mlp"): the hook scope of f; what joins the residual is `hook_{name}_out`, a
        pre-norm's output `ln1` / `ln2` / `ln_cross` `.hook_normalized`."""
        f = _scoped(name, f)
        if self.placement == "post":
            return norm(x + self._drop(hook(f"hook_{name}_out", f(x))))
        if self.placement == "output":
            return x + self._drop(hook(f"hook_{name}_out", norm(f(x))))
        y = f(hooked_norm(_NORM_HOOKS[name], norm, x))
        if post_norm is not None:
            y = post_norm(y)
        return x + self._drop(hook(f"hook_{name}_out", y))

    def _first_norm_residual(self, x, attn, layer):
        """The attention sublayer with `first_norm_residual`: h = attn_norm(x), and at
        layer 0 the residual is h (`layer` traced under a scan: a select)."""
        if layer is None:
            raise ValueError("first_norm_residual: the block needs its layer index (layer=)")
        h = hooked_norm("ln1", self.attn_norm, x)
        if isinstance(layer, int):
            x = h if layer == 0 else x
        else:
            x = jnp.where(layer == 0, h, x)
        return x + self._drop(hook("hook_attn_out", _scoped("attn", attn)(h)))

    def mixer_values(self, x: jax.Array) -> jax.Array:
        """The values `[B,T,K,Hv]` this block's self-attention projects from the block
        input x (through its norm, as the placement says): the first layer's values of
        a value-residual stack (`MultiHeadAttention.values`)."""
        return self.attn.values(x if self.placement in ("post", "output") else self.attn_norm(x))

    def __call__(self, x: jax.Array, *, mask=None, bias=None, positions=None,
                 context=None, context_mask=None, context_bias=None, context_positions=None,
                 context_rows=None, state=None, slots=None, layer=None, first_values=None,
                 shared=None, embeddings=None, rope_tables=None):
        """x `[B,T,D]`; `context [B,S,D]` is the encoder output for cross-attention.
        `layer` (the layer index) and `first_values` (the first layer's values), when
        given, go to the self-attention (differential attention, value residual), and
        so do `rope_tables` (its RoPE's `tables(positions)`, computed by the stack).
        `shared` (the shared block this layer uses) and `embeddings` `[B,T,D]` (the
        stack's input) go to `mixer_input`; a block with one needs them.

        Decoding: `state` is a dict of sublayer states ("attn", "shared" for a
        `mixer_input`, "cross" with cross-attention; each made by the sublayer's
        `init_state`), each passed to its sublayer with the step's `slots`
        (`tfjax.nn.state.Slots`); then the block returns `(x, new_state)`. A
        cross-attention state that holds the encoder's K/V needs no `context`.
        """
        new_state = None if state is None else dict(state)

        def call(name, module, *args, **kw):
            if state is None:
                return module(*args, **kw)
            y, new_state[name] = module(*args, state=state[name], slots=slots, **kw)
            return y

        depth = {} if layer is None and first_values is None else dict(
            layer=layer, first_values=first_values)
        if rope_tables is not None:
            depth["rope_tables"] = rope_tables
        if self.mixer_context:
            if context is None and context_bias is None:  # no image: the layer is skipped
                return x if state is None else (x, new_state)
            attn = lambda h: call("attn", self.attn, h, context,  # noqa: E731
                                  mask=context_mask, bias=context_bias)
        else:
            attn = lambda h: call("attn", self.attn, h, mask=mask, bias=bias,  # noqa: E731
                                  positions=positions, **depth)
        ffn = self.ffn
        if self.attn_gate is not None:
            attn = _gated(attn, self.attn_gate)
            ffn = _gated(_rows(ffn, context_rows), self.ffn_gate) if ffn is not None else None
        x = hook("hook_resid_pre", x)
        if self.parallel:
            h = hooked_norm("ln1", self.attn_norm, x)
            h2 = h if self.ffn_norm is None else hooked_norm("ln2", self.ffn_norm, x)
            x = x + self._drop(hook("hook_attn_out", _scoped("attn", attn)(h)))
            if self.ffn is not None:
                x = x + self._drop(hook("hook_mlp_out", _scoped("mlp", self.ffn)(h2)))
            x = hook("hook_resid_post", x)
            return x if state is None else (x, new_state)
        if self.first_norm_residual:
            x = self._first_norm_residual(x, attn, layer)
        elif self.mixer_input is not None:
            if shared is None or embeddings is None:
                raise ValueError("this block has a mixer_input (a shared block's use): pass "
                                 "shared= (the block) and embeddings= (the stack's input)")
            g = _scoped("shared", call)("shared", self.mixer_input, x, block=shared,
                                        embeddings=embeddings, mask=mask, bias=bias,
                                        positions=positions)
            h = hooked_norm("ln1", self.attn_norm, x + g)
            x = x + self._drop(hook("hook_attn_out", _scoped("attn", attn)(h)))
        else:
            x = self._sublayer(x, attn, self.attn_norm, self.post_attn_norm, "attn")
        if self.cross_attn is not None:
            if context is None and state is None:
                raise ValueError("this block has cross-attention: pass context (the encoder output)")
            cross = lambda h: call("cross", self.cross_attn, h, context,  # noqa: E731
                                   mask=context_mask, bias=context_bias, positions=positions,
                                   kv_positions=context_positions)
            x = self._sublayer(x, cross, self.cross_norm, self.post_cross_norm, "cross_attn")
        if ffn is not None:  # None: a mixer-only layer (Mamba)
            x = hook("hook_resid_mid", x)
            x = self._sublayer(x, ffn, self.ffn_norm, self.post_ffn_norm, "mlp")
        x = hook("hook_resid_post", x)
        return x if state is None else (x, new_state)
