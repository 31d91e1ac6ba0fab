"""The standard readings of a decoder LM over `run_with_cache` / `run_with_hooks`:
logit lens, direct logit attribution per head, activation-patching sweeps and head
ablation, each returning arrays. Conventions are TransformerLens's (patching puts
clean activations into the corrupted run; DLA freezes the final norm's scale at the
final residual, `apply_ln_to_stack`). See docs/interp.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import models
from tfjax.interp.runs import run_with_cache, run_with_hooks
from tfjax.nn import hooks

__all__ = ["ablate_heads", "direct_logit_attribution", "logit_attribution", "logit_lens",
           "patching_sweep"]

PATCHABLE = {"resid_pre": "hook_resid_pre", "heads": "attn.hook_z"}


def logit_lens(model, tokens, *, log_probs: bool = False) -> jax.Array:
    """`[L+1, B, T, V]`: the embeddings (`blocks.0.hook_resid_pre`) and each layer's
    output (`blocks.{l}.hook_resid_post`) through the final norm and the head, as if
    the model stopped there (row L is the model's logits). `log_probs`: log-softmax."""
    _require_decoder(model, "logit_lens")
    names = _layer_names(model, "hook_resid_pre")[:1] + _layer_names(model, "hook_resid_post")
    _, cache = run_with_cache(model, tokens, names)
    stack = jnp.stack([cache[n] for n in names])
    L1, B, T, D = stack.shape
    logits = _unembed(model, stack.reshape(L1 * B, T, D)).reshape(L1, B, T, -1)
    return jax.nn.log_softmax(logits, axis=-1) if log_probs else logits


def logit_attribution(model, tokens, residual_stack, answer_tokens, wrong_tokens=None, *,
                      cache=None) -> jax.Array:
    """`[..., B, T]`: how much each component of `residual_stack` `[..., B, T, D]`
    (vectors the residual stream sums) adds to the logit of `answer_tokens` `[B]`
    (minus that of `wrong_tokens` `[B]`), the final norm's scale frozen at the final
    residual of `model(tokens)` (`cache`: a `run_with_cache` cache that has it). The
    attributions of components summing to the final residual, plus the logit (diff)
    with `ln_final.hook_normalized` zeroed (the norm's bias), add up to the logit (diff)."""
    _require_linear_head(model, "logit_attribution")
    final = _layer_names(model, "hook_resid_post")[-1]
    needed = (final, "ln_final.hook_normalized")
    if cache is None or any(n not in cache for n in needed):
        _, cache = run_with_cache(model, tokens, needed)
    resid, normalized = cache[final].astype(jnp.float32), cache["ln_final.hook_normalized"]
    centred = _centre(model, resid)
    # normalized = centred / s at every position: 1/s by projection, whatever the norm's eps
    inv_scale = jnp.sum(normalized * centred, -1) / jnp.maximum(jnp.sum(centred * centred, -1),
                                                                  jnp.finfo(jnp.float32).tiny)
    direction = _answer_direction(model, answer_tokens, wrong_tokens, resid.shape[-1])
    stack = _centre(model, jnp.asarray(residual_stack, jnp.float32))
    return jnp.einsum("...btd,bd->...bt", stack, direction) * inv_scale


def direct_logit_attribution(model, tokens, answer_tokens, wrong_tokens=None, *,
                             per_position: bool = False) -> jax.Array:
    """`[L, N]`: each head's direct effect on the last position's logit of
    `answer_tokens` `[B]` (minus `wrong_tokens`), its `hook_z` through its slice of
    the output projection, then `logit_attribution`; the mean over the batch.
    `per_position`: `[L, N, T]`, the answer's logit at every position."""
    _require_linear_head(model, "direct_logit_attribution")
    cfg = model.config
    if cfg.norm_placement in ("sandwich", "post"):
        raise ValueError(f"direct_logit_attribution: model.norm_placement={cfg.norm_placement!r} "
                         f"normalises the attention output, so a head's output is not a sum "
                         f"term of the residual; use a pre-norm model")
    z_names = _layer_names(model, "attn.hook_z")
    final = _layer_names(model, "hook_resid_post")[-1]
    _, cache = run_with_cache(model, tokens, (*z_names, final, "ln_final.hook_normalized"))
    kernels = _output_kernels(model)
    heads = jnp.stack([jnp.einsum("btnh,nhd->nbtd", cache[n].astype(jnp.float32),
                                  k.astype(jnp.float32)) for n, k in zip(z_names, kernels)])
    attrs = logit_attribution(model, tokens, heads, answer_tokens, wrong_tokens, cache=cache)
    attrs = attrs.mean(axis=2)  # [L, N, T]
    return attrs if per_position else attrs[..., -1]


def patching_sweep(model, clean, corrupted, metric: Callable[[jax.Array], jax.Array],
                   what: str = "resid_pre", *, chunk: int = 16) -> jax.Array:
    """`metric(logits)` (a scalar) of the corrupted run with one cell's activation
    replaced by the clean run's: `what="resid_pre"` -> `[L, T]` (layer l's
    `hook_resid_pre` at position p), `"heads"` -> `[L, N]` (head n's `hook_z` at
    every position). One compiled patched run, the cell a traced argument, looped
    over the cells `chunk` at a time (vmapped: memory grows with `chunk`)."""
    if what not in PATCHABLE:
        raise ValueError(f"patching_sweep: what={what!r}; choose one of {sorted(PATCHABLE)}")
    if jnp.shape(clean) != jnp.shape(corrupted):
        raise ValueError(f"patching_sweep: clean {jnp.shape(clean)} and corrupted "
                         f"{jnp.shape(corrupted)} tokens differ in shape; patching needs "
                         f"them aligned")
    names = _layer_names(model, PATCHABLE[what])
    _, cache = run_with_cache(model, clean, names)
    stacked = jnp.stack([cache[n] for n in names])  # [L, B, T, D] or [L, B, T, N, H]
    L = len(names)
    width = stacked.shape[2] if what == "resid_pre" else stacked.shape[3]
    layer, index = (a.ravel() for a in jnp.meshgrid(jnp.arange(L), jnp.arange(width),
                                                     indexing="ij"))
    wanted = frozenset(names)
    graphdef, state = nnx.split(model)

    def one(cell, state, stacked, corrupted):
        cell_layer, cell_index = cell

        def patch(x, hook):
            axis = 1 if what == "resid_pre" else 2
            shape = [1] * x.ndim
            shape[axis] = x.shape[axis]
            hit = (jnp.arange(x.shape[axis]).reshape(shape) == cell_index) & (
                cell_layer == hook.layer)
            return jnp.where(hit, stacked[hook.layer].astype(x.dtype), x)

        session = hooks.Session(match=[(wanted.__contains__, patch)])
        with hooks.session(session):
            return jnp.asarray(metric(nnx.merge(graphdef, state)(corrupted)), jnp.float32)

    cells = L * width
    if int(chunk) < 1:
        raise ValueError(f"patching_sweep: chunk={chunk}; cells run at once, at least 1")
    chunk = min(int(chunk), cells)
    steps = -(-cells // chunk)
    pad = steps * chunk - cells  # the last chunk cut short: padded with cell 0, dropped after
    layer, index = (jnp.pad(a, (0, pad)).reshape(steps, chunk) for a in (layer, index))

    @jax.jit
    def sweep(state, stacked, corrupted, layer, index):
        # the model's arrays go in as the loop's carry: nnx's transforms inside the model
        # need them traced at the loop's level, not closed over from the jit's
        def step(carry, cell):
            return carry, jax.vmap(one, in_axes=(0, None, None, None))(cell, *carry)

        return jax.lax.scan(step, (state, stacked, corrupted), (layer, index))[1]

    out = sweep(state, stacked, corrupted, layer, index).reshape(-1)[:cells]
    return out.reshape(L, width)


def ablate_heads(model, tokens, heads: Sequence[tuple[int, int]], how: str = "zero"):
    """`[B, T, V]` logits with each `(layer, head)` of `heads` ablated at its `hook_z`:
    `"zero"` sets it to 0; `"mean"` to its mean over the batch and positions in the
    unablated run on `tokens` (TransformerLens's mean ablation)."""
    if how not in ("zero", "mean"):
        raise ValueError(f"ablate_heads: how={how!r}; choose 'zero' or 'mean'")
    L, N = model.config.num_layers, model.config.num_heads
    by_layer: dict[int, list[int]] = {}
    for pair in heads:
        layer, head = (int(v) for v in pair)
        if not (0 <= layer < L and 0 <= head < N):
            raise ValueError(f"ablate_heads: (layer, head) {tuple(pair)} is not in "
                             f"0..{L - 1} x 0..{N - 1}")
        by_layer.setdefault(layer, []).append(head)
    names = {layer: f"blocks.{layer}.attn.hook_z" for layer in by_layer}
    means = {}
    if how == "mean" and names:
        _, cache = run_with_cache(model, tokens, list(names.values()))
        means = {layer: cache[n].mean(axis=(0, 1)) for layer, n in names.items()}  # [N, H]

    def ablate(z, hook):
        idx = jnp.asarray(by_layer[hook.layer])
        value = 0.0 if how == "zero" else means[hook.layer][idx].astype(z.dtype)
        return z.at[:, :, idx].set(value)

    return run_with_hooks(model, tokens, [(n, ablate) for n in names.values()])


def _layer_names(model, suffix: str) -> list[str]:
    return [f"blocks.{layer}.{suffix}" for layer in range(model.config.num_layers)]


def _require_decoder(model, what: str) -> None:
    if not all(hasattr(model, a) for a in ("head", "head_input", "config")):
        raise TypeError(f"{what}: takes a decoder LM tfjax.models.build made (head_input, "
                        f"head), not a {type(model).__name__}")


def _require_linear_head(model, what: str) -> None:
    _require_decoder(model, what)
    if model.config.final_softcap:
        raise ValueError(f"{what}: model.final_softcap={model.config.final_softcap} makes the "
                         f"logits nonlinear in the residual; attribution needs final_softcap=None")
    if model.final_norm is None:
        raise ValueError(f"{what}: the model has no final norm (model.final_norm=False); "
                         f"attribution freezes its scale")


def _unembed(model, x):
    @nnx.jit
    def head(model, x):
        return model.head(model.head_input(x))

    return head(model, x)


def _centre(model, x):
    """x minus its mean over the model dim where the final norm is a LayerNorm."""
    if isinstance(model.final_norm, nnx.LayerNorm):
        return x - x.mean(-1, keepdims=True)
    return x


def _answer_direction(model, answer_tokens, wrong_tokens, d_model: int) -> jax.Array:
    """`[B, D]`: d(logit[answer] - logit[wrong]) / d(normalised final residual); the
    head after the final norm's normalisation is affine, so the gradient is constant."""
    answer = jnp.asarray(answer_tokens)
    if answer.ndim != 1:
        raise ValueError(f"answer_tokens: one token per row [B], got shape {answer.shape}")
    wrong = None if wrong_tokens is None else jnp.asarray(wrong_tokens)
    if wrong is not None and wrong.shape != answer.shape:
        raise ValueError(f"wrong_tokens: shape {wrong.shape}, answer_tokens {answer.shape}; "
                         f"one wrong token per row")
    graphdef, state = nnx.split(model)

    @jax.jit
    def direction(state, answer, wrong):
        def logit(y):  # y: the final norm's normalised input [B, 1, D]
            session = hooks.Session()
            session.hooks["ln_final.hook_normalized"] = [lambda _, hook: y]
            m = nnx.merge(graphdef, state)
            with hooks.session(session):
                out = m.head(m.head_input(jnp.zeros_like(y)))[:, 0]  # [B, V]
            value = jnp.take_along_axis(out, answer[:, None], -1)
            if wrong is not None:
                value = value - jnp.take_along_axis(out, wrong[:, None], -1)
            return value.sum()

        return jax.grad(logit)(jnp.zeros((answer.shape[0], 1, d_model), jnp.float32))[:, 0]

    return direction(state, answer, wrong)


def _output_kernels(model) -> list[jax.Array]:
    """Each layer's attention output projection `[N, H, D]` (scanned cycles unrolled)."""
    blocks = models.unrolled(model).layers.blocks
    kernels = []
    for layer, block in enumerate(blocks):
        attn = getattr(block, "attn", None)
        o = getattr(attn, "o", None)
        if o is None or not hasattr(o, "kernel"):
            raise ValueError(f"direct_logit_attribution: layer {layer} "
                             f"({type(block).__name__}) has no attention output projection "
                             f"attn.o; DLA per head needs attention layers")
        kernels.append(o.kernel[...])
    return kernels
