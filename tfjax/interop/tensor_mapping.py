"""The tensor helpers the checkpoint families share: checkpoint tensors -> tfjax
parameters, `{our parameter path: array}`, by element movement only (transposes,
reshapes, indexing, stacking), so that `tfjax.interop.hf_invert` can run a family's
mapping backwards for export.

HF `Linear` weights `[out, in]` become our `[in, ...]` kernels with explicit head
axes (`q_proj [N*H, D] -> [D, N, H]`); paths are per layer, `(stack, i, ...)`, which
`tfjax.interop.hf` places by the stack's layout. `Weights` remembers what was read,
so a tensor left unread is an error (a feature we would silently drop). See
docs/interop.md.
"""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig

__all__ = ["Weights", "attention_weights", "embedding_and_head", "fused_qkv_weights",
           "head_weights", "heads_in", "heads_out", "linear_weights", "mtp_weights",
           "norm_weights", "qk_norm_weights", "stacked_experts", "swiglu_weights"]


class Weights:
    """The checkpoint's tensors; remembers which were read so leftovers are an error.
    `prefix_aliases`: module prefixes a bare base-model checkpoint lacks (a family's
    `prefix`: `LlamaModel` saves without "model.")."""

    def __init__(self, ckpt, prefix_aliases: tuple[str, ...] = ()):
        self.ckpt = ckpt
        self.used: set[str] = set()
        self.aliases = prefix_aliases

    def _key(self, name: str) -> str:
        if name in self.ckpt:
            return name
        for a in self.aliases:  # e.g. a bare `LlamaModel` checkpoint without "model."
            if name.startswith(a) and name[len(a):] in self.ckpt:
                return name[len(a):]
        raise ValueError(f"checkpoint has no tensor {name!r} (has e.g. "
                         f"{', '.join(sorted(self.ckpt)[:5])})")

    def __contains__(self, name: str) -> bool:
        try:
            self._key(name)
            return True
        except ValueError:
            return False

    def __getitem__(self, name: str) -> np.ndarray:
        key = self._key(name)
        self.used.add(key)
        return self.ckpt[key]

    def ignore(self, *names: str) -> None:
        for n in names:
            if n in self:
                self.used.add(self._key(n))

    def leftovers(self) -> list[str]:
        return sorted(set(self.ckpt) - self.used)


def heads_in(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[heads*H, D]` -> our `[D, heads, H]`."""
    return w.T.reshape(w.shape[1], heads, H)


def heads_out(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[D, heads*H]` -> our `[heads, H, D]`."""
    return w.T.reshape(heads, H, w.shape[0])


def linear_weights(w: Weights, name: str, L: tuple, bias: bool) -> dict:
    """HF Linear `name` -> our kernel (and bias) at `L`."""
    out = {L + ("kernel",): w[f"{name}.weight"].T}
    if bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def norm_weights(w: Weights, name: str, L: tuple, cfg: ModelConfig) -> dict:
    """Norm `name` -> our scale (and a LayerNorm's bias) at `L`; Gemma's `(1 + w)`
    weights load as they are into `rmsnorm_plus_one`."""
    out = {L + ("scale",): w[f"{name}.weight"]}
    if cfg.norm == "layernorm" and cfg.norm_bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def head_weights(w: Weights, name: str, cfg: ModelConfig) -> dict:
    """The output projection `name` (`[V, D]`): ours `[D, V]`, or nothing when the
    model ties it to the embedding (the checkpoint's copy is then read and dropped)."""
    if cfg.tie_embeddings:
        w.ignore(name)
        return {}
    return {("embed", "head", "kernel"): w[name].T}


def embedding_and_head(w: Weights, cfg: ModelConfig, *,
                       embedding: str = "model.embed_tokens.weight",
                       final_norm: str = "model.norm", head: str = "lm_head.weight") -> dict:
    """The token embedding, the final norm and the (untied) output head of a causal LM
    (the names: a Llama-shaped `model.` checkpoint's)."""
    return {("embed", "tokens", "embedding"): w[embedding],
            **norm_weights(w, final_norm, ("final_norm",), cfg), **head_weights(w, head, cfg)}


def attention_weights(w: Weights, p: str, L: tuple, cfg: ModelConfig,
                      names=("q_proj", "k_proj", "v_proj", "o_proj")) -> dict:
    """Separate q/k/v/o Linears `p + name` (a name starting with "/" is a full name),
    their biases as `model.attention.qkv_bias` / `k_bias` / `out_bias` say."""
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    full = [n[1:] if n.startswith("/") else p + n for n in names]
    out = {}
    for ours, theirs, heads in zip("qkv", full[:3], (N, K, K)):
        out[L + (ours, "kernel")] = heads_in(w[f"{theirs}.weight"], heads, H)
        if cfg.attention.qkv_bias and (ours != "k" or cfg.attention.k_bias):
            out[L + (ours, "bias")] = w[f"{theirs}.bias"].reshape(heads, H)
    out[L + ("o", "kernel")] = heads_out(w[f"{full[3]}.weight"], N, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[f"{full[3]}.bias"]
    return out


def qk_norm_weights(w: Weights, p: str, A: tuple, cfg: ModelConfig) -> dict:
    """The QK-norms `p + q_norm` / `p + k_norm` of attention `A`."""
    return {**norm_weights(w, p + "q_norm", A + ("q_norm",), cfg),
            **norm_weights(w, p + "k_norm", A + ("k_norm",), cfg)}


def fused_qkv_weights(w: Weights, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """NeoX / BLOOM `query_key_value` `[N*3*H, D]` (per head: q, then k, then v) and
    `dense` -> our q, k, v, o at `L`."""
    N, H = cfg.num_heads, cfg.head_size
    W = w[p + "query_key_value.weight"]
    W = W.reshape(N, 3, H, W.shape[-1])
    out = {L + (n, "kernel"): np.transpose(W[:, j], (2, 0, 1)) for j, n in enumerate("qkv")}
    if cfg.attention.qkv_bias:
        b = w[p + "query_key_value.bias"].reshape(N, 3, H)
        out.update({L + (n, "bias"): b[:, j] for j, n in enumerate("qkv")})
    out[L + ("o", "kernel")] = heads_out(w[p + "dense.weight"], N, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[p + "dense.bias"]
    return out


def swiglu_weights(w: Weights, p: str, L: tuple, bias: bool = False) -> dict:
    """A gated MLP `p` (`p.gate_proj`, `p.up_proj`, `p.down_proj`) -> our FeedForward
    at `L` (`wi_gate`, `wi_up`, `wo`)."""
    out = {}
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out.update(linear_weights(w, f"{p}.{theirs}", L + (ours,), bias))
    return out


def stacked_experts(w: Weights, p: str, L: tuple, num_experts: int,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict:
    """Experts `p + experts.{e}.{name}` (the per-expert layout save_pretrained writes,
    each Linear `[out, in]`) stacked over E into our `wi_gate`, `wi_up`, `wo` at `L`;
    `names`: the gate, up and down Linears (Mixtral's w1, w3, w2)."""
    return {L + (ours,): np.stack([w[f"{p}experts.{e}.{theirs}.weight"].T
                                   for e in range(num_experts)])
            for ours, theirs in zip(("wi_gate", "wi_up", "wo"), names)}


def mtp_weights(w: Weights, cfg: ModelConfig, k: int, *, embed_norm: str, hidden_norm: str,
                norm: str, proj: str) -> dict:
    """MTP module k's own tensors (`tfjax.models.mtp.MTPModule`, its block aside) from
    their hub names: the two input norms, the output norm and the input projection
    `[D, 2D]` (eh_proj / fc, reading [embedding; hidden] as DeepSeek-V3 and Qwen3-Next
    order them) as `proj` `[2D, D]`, which reads [hidden; embedding]."""
    M = ("mtp", k)
    out = {**norm_weights(w, embed_norm, M + ("embed_norm",), cfg),
           **norm_weights(w, hidden_norm, M + ("hidden_norm",), cfg),
           **norm_weights(w, norm, M + ("norm",), cfg)}
    eh = w[f"{proj}.weight"]
    D = eh.shape[0]
    out[M + ("proj", "kernel")] = np.concatenate([eh[:, D:].T, eh[:, :D].T])
    return out
