"""Hugging Face checkpoint tensors -> tfjax parameters, one function per family.

Each `<family>_weights(w, cfg, hf) -> {our parameter path: array}` reads the
checkpoint through `Weights` (which remembers what was read, so a tensor left
unread is an error: it means a feature we would silently drop), with per-layer
paths `(stack, i, ...)` that `tfjax.interop.hf` places into the layer stack's
layout. HF `Linear` weights `[out, in]` become our `[in, ...]` kernels with
explicit head axes (`q_proj [N*H, D] -> [D, N, H]`); fused QKV matrices are split
by their per-family layout (NeoX / BLOOM `[N, 3, H]`, GPT-2 `[3, N, H]` Conv1D);
Mixtral's experts are stacked over E; Gemma's `(1 + w)` RMSNorm weights load as
is into `rmsnorm_plus_one`. `PREFIXES`: the module prefix of each family's
causal-LM checkpoint, which a bare base-model checkpoint lacks.
"""

from __future__ import annotations

import numpy as np

from tfjax.config import ModelConfig

__all__ = ["PREFIXES", "Weights", "bert_weights", "bloom_weights", "gpt2_weights",
           "llama_weights", "mamba_mixer_weights", "mamba_weights", "mtp_module_weights",
           "neox_weights",
           "t5_weights"]


class Weights:
    """The checkpoint's tensors; remembers which were read so leftovers are an error."""

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


def _heads_in(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[heads*H, D]` -> our `[D, heads, H]`."""
    return w.T.reshape(w.shape[1], heads, H)


def _heads_out(w: np.ndarray, heads: int, H: int) -> np.ndarray:
    """HF Linear `[D, heads*H]` -> our `[heads, H, D]`."""
    return w.T.reshape(heads, H, w.shape[0])


def _attention(w, p: str, L: tuple, cfg: ModelConfig,
               names=("q_proj", "k_proj", "v_proj", "o_proj")) -> dict:
    """Separate q/k/v/o Linears `p + name` (a name starting with "/" is a full name)."""
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    full = [n[1:] if n.startswith("/") else p + n for n in names]
    out = {}
    for ours, theirs, heads in zip("qkv", full[:3], (N, K, K)):
        out[L + (ours, "kernel")] = _heads_in(w[f"{theirs}.weight"], heads, H)
        if cfg.attention.qkv_bias:
            out[L + (ours, "bias")] = w[f"{theirs}.bias"].reshape(heads, H)
    out[L + ("o", "kernel")] = _heads_out(w[f"{full[3]}.weight"], N, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[f"{full[3]}.bias"]
    return out


def _linear(w, name: str, L: tuple, bias: bool) -> dict:
    out = {L + ("kernel",): w[f"{name}.weight"].T}
    if bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def mtp_module_weights(w, cfg: ModelConfig, k: int, *, embed_norm: str, hidden_norm: str,
                       norm: str, proj: str) -> dict:
    """MTP module k's own tensors (`tfjax.models.mtp.MTPModule`, its block aside) from
    their hub names: the two input norms, the output norm and the input projection
    `[D, 2D]` (eh_proj / fc, reading [embedding; hidden] as DeepSeek-V3 and Qwen3-Next
    order them) as `proj` `[2D, D]`, which reads [hidden; embedding]."""
    M = ("mtp", k)
    out = {**_norm(w, embed_norm, M + ("embed_norm",), cfg),
           **_norm(w, hidden_norm, M + ("hidden_norm",), cfg),
           **_norm(w, norm, M + ("norm",), cfg)}
    eh = w[f"{proj}.weight"]
    D = eh.shape[0]
    out[M + ("proj", "kernel")] = np.concatenate([eh[:, D:].T, eh[:, :D].T])
    return out


def _norm(w, name: str, L: tuple, cfg: ModelConfig) -> dict:
    out = {L + ("scale",): w[f"{name}.weight"]}
    if cfg.norm == "layernorm" and cfg.norm_bias:
        out[L + ("bias",)] = w[f"{name}.bias"]
    return out


def llama_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["model.embed_tokens.weight"],
           **_norm(w, "model.norm", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    sandwich = cfg.norm_placement == "sandwich"
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out.update(_attention(w, p + "self_attn.", L + ("attn",), cfg))
        if cfg.attention.qk_norm:
            out.update(_norm(w, p + "self_attn.q_norm", L + ("attn", "q_norm"), cfg))
            out.update(_norm(w, p + "self_attn.k_norm", L + ("attn", "k_norm"), cfg))
        out.update(_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg))
        if sandwich:  # Gemma 2
            out.update(_norm(w, p + "post_attention_layernorm", L + ("post_attn_norm",), cfg))
            out.update(_norm(w, p + "pre_feedforward_layernorm", L + ("ffn_norm",), cfg))
            out.update(_norm(w, p + "post_feedforward_layernorm", L + ("post_ffn_norm",), cfg))
        else:
            out.update(_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg))
        if cfg.ffn_kind(i) == "moe":
            out.update(_mixtral_experts(w, p + "block_sparse_moe.", L + ("ffn",), cfg))
        else:
            for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
                out.update(_linear(w, p + "mlp." + theirs, L + ("ffn", ours), cfg.ffn_bias))
    return out


def _mixtral_experts(w: Weights, p: str, L: tuple, cfg: ModelConfig, *, router: str = "gate",
                     names: tuple[str, str, str] = ("w1", "w3", "w2")) -> dict:
    """Router `p + router` and experts `p + experts.{e}.{name}` stacked over E; `names`
    the gate, up and down Linears (Mixtral's w1, w3, w2; Qwen / Jamba: gate_proj, ...)."""
    E = cfg.moe.num_experts
    out = {L + ("router",): w[p + router + ".weight"].T}  # [E, D] -> [D, E]
    # The per-expert layout save_pretrained writes: gate, up, down, each [out, in].
    for ours, theirs in zip(("wi_gate", "wi_up", "wo"), names):
        out[L + (ours,)] = np.stack([w[f"{p}experts.{e}.{theirs}.weight"].T for e in range(E)])
    return out


def _fused_qkv(w, p: str, L: tuple, cfg: ModelConfig) -> dict:
    """NeoX / BLOOM `query_key_value` `[N*3*H, D]`: per head, q then k then v."""
    N, H = cfg.num_heads, cfg.head_size
    W = w[p + "query_key_value.weight"]
    W = W.reshape(N, 3, H, W.shape[-1])
    out = {L + (n, "kernel"): np.transpose(W[:, j], (2, 0, 1)) for j, n in enumerate("qkv")}
    if cfg.attention.qkv_bias:
        b = w[p + "query_key_value.bias"].reshape(N, 3, H)
        out.update({L + (n, "bias"): b[:, j] for j, n in enumerate("qkv")})
    out[L + ("o", "kernel")] = _heads_out(w[p + "dense.weight"], N, H)
    if cfg.attention.out_bias:
        out[L + ("o", "bias")] = w[p + "dense.bias"]
    return out


def _head(w: Weights, name: str, cfg: ModelConfig) -> dict:
    """The output projection `name` (`[V, D]`): ours `[D, V]`, or nothing when the
    model ties it to the embedding (the checkpoint's copy is then read and dropped)."""
    if cfg.tie_embeddings:
        w.ignore(name)
        return {}
    return {("embed", "head", "kernel"): w[name].T}


def _fused_layer(w: Weights, p: str, L: tuple, cfg: ModelConfig, *, attention: str) -> dict:
    """A NeoX / BLOOM layer: fused QKV under `p + attention`, two LayerNorms, a
    dense_h_to_4h / dense_4h_to_h MLP with biases."""
    return {**_fused_qkv(w, p + attention, L + ("attn",), cfg),
            **_norm(w, p + "input_layernorm", L + ("attn_norm",), cfg),
            **_norm(w, p + "post_attention_layernorm", L + ("ffn_norm",), cfg),
            **_linear(w, p + "mlp.dense_h_to_4h", L + ("ffn", "wi"), True),
            **_linear(w, p + "mlp.dense_4h_to_h", L + ("ffn", "wo"), True)}


def neox_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["gpt_neox.embed_in.weight"],
           **_norm(w, "gpt_neox.final_layer_norm", ("final_norm",), cfg)}
    out.update(_head(w, "embed_out.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"gpt_neox.layers.{i}.", ("layers", i)
        out.update(_fused_layer(w, p, L, cfg, attention="attention."))
        w.ignore(p + "attention.bias", p + "attention.masked_bias", p + "attention.rotary_emb.inv_freq")
    return out


def bloom_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["transformer.word_embeddings.weight"],
           **_norm(w, "transformer.word_embeddings_layernorm", ("embed", "norm"), cfg),
           **_norm(w, "transformer.ln_f", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        out.update(_fused_layer(w, p, L, cfg, attention="self_attention."))
    return out


def gpt2_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    N, H, D = cfg.num_heads, cfg.head_size, cfg.d_model
    out = {("embed", "tokens", "embedding"): w["transformer.wte.weight"],
           ("embed", "positions", "embedding"): w["transformer.wpe.weight"],
           **_norm(w, "transformer.ln_f", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"transformer.h.{i}.", ("layers", i)
        A = L + ("attn",)
        W = w[p + "attn.c_attn.weight"].reshape(D, 3, N, H)  # Conv1D: [in, out], out = [3, N, H]
        b = w[p + "attn.c_attn.bias"].reshape(3, N, H)
        for j, n in enumerate("qkv"):
            out[A + (n, "kernel")], out[A + (n, "bias")] = W[:, j], b[j]
        out[A + ("o", "kernel")] = w[p + "attn.c_proj.weight"].reshape(N, H, D)
        out[A + ("o", "bias")] = w[p + "attn.c_proj.bias"]
        out.update(_norm(w, p + "ln_1", L + ("attn_norm",), cfg))
        out.update(_norm(w, p + "ln_2", L + ("ffn_norm",), cfg))
        for ours, theirs in (("wi", "c_fc"), ("wo", "c_proj")):  # Conv1D: no transpose
            out[L + ("ffn", ours, "kernel")] = w[f"{p}mlp.{theirs}.weight"]
            out[L + ("ffn", ours, "bias")] = w[f"{p}mlp.{theirs}.bias"]
        w.ignore(p + "attn.bias", p + "attn.masked_bias")
    return out


def bert_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    e = "bert.embeddings."
    out = {("embed", "tokens", "embedding"): w[e + "word_embeddings.weight"],
           ("embed", "positions", "embedding"): w[e + "position_embeddings.weight"],
           ("embed", "token_types", "embedding"): w[e + "token_type_embeddings.weight"],
           **_norm(w, e + "LayerNorm", ("embed", "norm"), cfg)}
    w.ignore(e + "position_ids", e + "token_type_ids")
    for i in range(cfg.num_layers):
        p, L = f"bert.encoder.layer.{i}.", ("layers", i)
        out.update(_attention(w, p + "attention.self.", L + ("attn",), cfg,
                              names=("query", "key", "value", f"/{p}attention.output.dense")))
        out.update(_norm(w, p + "attention.output.LayerNorm", L + ("attn_norm",), cfg))
        out.update(_linear(w, p + "intermediate.dense", L + ("ffn", "wi"), True))
        out.update(_linear(w, p + "output.dense", L + ("ffn", "wo"), True))
        out.update(_norm(w, p + "output.LayerNorm", L + ("ffn_norm",), cfg))
    c = "cls.predictions."
    out.update(_linear(w, c + "transform.dense", ("mlm_dense",), True))
    out.update(_norm(w, c + "transform.LayerNorm", ("mlm_norm",), cfg))
    out[("mlm_bias",)] = w[c + "bias"]
    out.update(_head(w, c + "decoder.weight", cfg))
    w.ignore(c + "decoder.bias")  # the MLM bias is `mlm_bias` (cls.predictions.bias), tied to it
    if "bert.pooler.dense.weight" in w:
        out.update(_linear(w, "bert.pooler.dense", ("pooler",), True))
    w.ignore("cls.seq_relationship.weight", "cls.seq_relationship.bias")  # NSP head
    return out


def t5_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["shared.weight"]}
    w.ignore("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    out.update(_head(w, "lm_head.weight", cfg))
    qkvo = ("q", "k", "v", "o")

    def ffn(p, L):
        if cfg.activation in ("relu", "gelu", "gelu_tanh", "silu"):
            pairs = (("wi", "wi"), ("wo", "wo"))
        else:
            pairs = (("wi_gate", "wi_0"), ("wi_up", "wi_1"), ("wo", "wo"))
        return {k: v for ours, theirs in pairs
                for k, v in _linear(w, f"{p}.DenseReluDense.{theirs}", L + ("ffn", ours), False).items()}

    for stack, n in (("encoder", cfg.encoder_layers), ("decoder", cfg.num_layers)):
        out[(f"{stack}_rel_bias", "embedding")] = w[
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        out.update(_norm(w, f"{stack}.final_layer_norm", (f"{stack}_norm",), cfg))
        for i in range(n):
            p, L = f"{stack}.block.{i}.layer.", (stack, i)
            out.update(_attention(w, p + "0.SelfAttention.", L + ("attn",), cfg, names=qkvo))
            out.update(_norm(w, p + "0.layer_norm", L + ("attn_norm",), cfg))
            f = 1
            if stack == "decoder":
                out.update(_attention(w, p + "1.EncDecAttention.", L + ("cross_attn",), cfg,
                                      names=qkvo))
                out.update(_norm(w, p + "1.layer_norm", L + ("cross_norm",), cfg))
                f = 2
            out.update(ffn(f"{p}{f}", L))
            out.update(_norm(w, f"{p}{f}.layer_norm", L + ("ffn_norm",), cfg))
    return out


def mamba_weights(w: Weights, cfg: ModelConfig, hf: dict) -> dict:
    out = {("embed", "tokens", "embedding"): w["backbone.embeddings.weight"],
           **_norm(w, "backbone.norm_f", ("final_norm",), cfg)}
    out.update(_head(w, "lm_head.weight", cfg))
    for i in range(cfg.num_layers):
        p, L = f"backbone.layers.{i}.", ("layers", i)
        M = L + ("attn",)  # the mixer sits where attention does
        out.update(_norm(w, p + "norm", L + ("attn_norm",), cfg))
        out.update(mamba_mixer_weights(w, p + "mixer.", M, cfg))
    return out


def mamba_mixer_weights(w: Weights, m: str, M: tuple, cfg: ModelConfig) -> dict:
    """One Mamba mixer `m` (HF `MambaMixer` / `JambaMambaMixer`) -> our `Mamba` at `M`;
    with `model.ssm.inner_norm`, Jamba's dt / B / C RMSNorms too."""
    D, Di = cfg.d_model, cfg.ssm.expand * cfg.d_model
    out = {M + ("in_proj",): w[m + "in_proj.weight"].T.reshape(D, 2, Di)}  # rows: x then z
    if cfg.ssm.proj_bias:
        out[M + ("in_bias",)] = w[m + "in_proj.bias"].reshape(2, Di)
        out[M + ("out_bias",)] = w[m + "out_proj.bias"]
    out[M + ("conv_w",)] = w[m + "conv1d.weight"][:, 0, :].T  # [Di, 1, K] -> [K, Di]
    if cfg.ssm.conv_bias:
        out[M + ("conv_b",)] = w[m + "conv1d.bias"]
    out[M + ("x_proj",)] = w[m + "x_proj.weight"].T  # [R + 2N, Di] -> [Di, R + 2N]
    out[M + ("dt_proj",)] = w[m + "dt_proj.weight"].T  # [Di, R] -> [R, Di]
    out[M + ("dt_bias",)] = w[m + "dt_proj.bias"]
    out[M + ("A_log",)] = w[m + "A_log"]
    out[M + ("D",)] = w[m + "D"]
    out[M + ("out_proj",)] = w[m + "out_proj.weight"].T
    if cfg.ssm.inner_norm:
        for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"),
                             ("c_norm", "c_layernorm")):
            out[M + (ours, "scale")] = w[f"{m}{theirs}.weight"]
    return out


PREFIXES = {"llama": "model.", "mistral": "model.", "qwen3": "model.", "mixtral": "model.",
             "gemma2": "model.", "gpt2": "transformer.", "gpt_neox": "gpt_neox.",
             "bloom": "transformer.", "bert": "bert.", "mamba": "backbone.",
             "mamba2": "backbone.", "qwen3_next": "model.", "jamba": "model.",
             **dict.fromkeys(("qwen2", "olmo2", "smollm3", "gemma3_text", "phi3", "qwen3_moe"),
                             "model.")}
