"""Hugging Face checkpoints in and out of tfjax, with logit parity.

    model, cfg = tfjax.interop.hf.load("path/to/checkpoint")       # config.json + *.safetensors
    logits = model(input_ids)                                       # causal LMs: [B, T, V]
    tfjax.interop.hf.export(model, "out/")                          # Llama family -> HF

`load` reads a local directory as `save_pretrained` writes it: `config.json` and
`model.safetensors` (or shards with `model.safetensors.index.json`), without torch
(`tfjax.interop.safetensors_io` memory-maps the files; bfloat16 comes out as an
`ml_dtypes` array). Each supported `model_type` is a `Family` in `FAMILIES`, two
functions:

- **config** (`tfjax.interop.hf_config`): the HF config dict -> `ModelConfig`
  fields; an HF option that changes the computation is mapped or refused with
  `NotImplementedError` naming it.
- **weights** (`tfjax.interop.hf_weights`): the checkpoint -> `{our parameter path:
  array}`, per-layer paths `(stack, i, ...)`; a tensor left unread is an error.

Placement (here) puts layer i of each stack where the stack's layout says
(`tfjax.models.StackLayout.where`: a scanned cycle position and its index on the
stacked axis, or an unrolled block), checks every shape, casts to `dtype` and,
with a `mesh`, puts each parameter on the mesh with the sharding its logical axis
names give (`tfjax.parallel.rules`). Each converted convention is checked by a
parity test in tests/interop; BLOOM's ALiBi `m * k` equals our `-m * |q - k|` up to
a per-query constant (softmax-invariant). Loaded models are for inference: dropout
is off. `export` writes the Llama family back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import DEFAULT_RULES, DTYPES, ModelConfig, model_config
from tfjax.interop import hf_config, hf_weights
from tfjax.interop.hf_weights import PREFIXES, Weights
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file
from tfjax.models import EncoderModel, StackLayout, build, check_names
from tfjax.parallel.rules import logical_rules, spec_for, variable_axes
from tfjax.registry import Registry

__all__ = ["FAMILIES", "Family", "HFEncoder", "config_from_hf", "export", "load", "load_state"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: its config mapping and its tensor mapping."""

    config: Callable[[dict], dict]
    weights: Callable[[Weights, ModelConfig, dict], dict]


FAMILIES: Registry[Family] = Registry("Hugging Face model_type")
for _names, _fam in (
        (("llama", "mistral"), Family(hf_config.llama_config, hf_weights.llama_weights)),
        (("qwen3",), Family(hf_config.qwen3_config, hf_weights.llama_weights)),
        (("mixtral",), Family(hf_config.mixtral_config, hf_weights.llama_weights)),
        (("gemma2",), Family(hf_config.gemma2_config, hf_weights.llama_weights)),
        (("gpt2",), Family(hf_config.gpt2_config, hf_weights.gpt2_weights)),
        (("gpt_neox",), Family(hf_config.neox_config, hf_weights.neox_weights)),
        (("bloom",), Family(hf_config.bloom_config, hf_weights.bloom_weights)),
        (("bert",), Family(hf_config.bert_config, hf_weights.bert_weights)),
        (("t5",), Family(hf_config.t5_config, hf_weights.t5_weights)),
        (("mamba",), Family(hf_config.mamba_config, hf_weights.mamba_weights))):
    for _n in _names:
        FAMILIES.register(_n, _fam)


# --------------------------------------------------------------------------- #
# Placement: per-layer arrays -> the (scanned) parameter tree.
# --------------------------------------------------------------------------- #


def _layouts(cfg: ModelConfig) -> dict[str, StackLayout]:
    """The model's layer stacks by attribute name, with their layouts."""
    if cfg.arch == "encoder_decoder":
        return {"encoder": StackLayout.of(cfg, cfg.encoder_layers),
                "decoder": StackLayout.of(cfg, cfg.num_layers)}
    return {"layers": StackLayout.of(cfg)}


def _target(cfg: ModelConfig, key: tuple) -> tuple[tuple, int | None]:
    """Our per-layer key `(stack, i, ...)` -> (state path, index in the scanned stack)."""
    layouts = _layouts(cfg)
    if key[0] not in layouts or not isinstance(key[1], int):
        return key, None
    stack, i, *rest = key
    where = layouts[stack].where(i)
    if where[0] == "cycles":
        _, j, c = where
        return (stack, "cycles", "layers", j, *rest), c
    return (stack, "blocks", where[1], *rest), None


def _abstract(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))


def load_state(arrays: dict, cfg: ModelConfig, *, mesh=None, rules=DEFAULT_RULES,
               allow_missing: tuple[tuple, ...] = ()) -> nnx.Module:
    """Build the model of `cfg` with its parameters from `arrays` (`{our key: array}`,
    per-layer keys `(stack, i, ...)`), cast to `cfg.param_dtype`, on `mesh` if given.
    Every parameter must be given (except paths in `allow_missing`, left at init)."""
    abstract = _abstract(cfg)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values: dict[tuple, Any] = {}
    for key, arr in arrays.items():
        path, idx = _target(cfg, key)
        if path not in flat:
            raise ValueError(f"{key}: no such parameter {path} in the tfjax model")
        shape = flat[path].get_value().shape
        if idx is None:
            values[path] = arr
            want = shape
        else:
            values.setdefault(path, [None] * shape[0])[idx] = arr
            want = shape[1:]
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"{key}: checkpoint shape {tuple(arr.shape)} != tfjax {tuple(want)}")
    lrules = logical_rules(rules) if mesh is not None else None
    out = []
    for path, var in flat.items():
        aval = var.get_value()
        if path in values:
            v = values[path]
            if isinstance(v, list):
                if any(a is None for a in v):
                    raise ValueError(f"{path}: layers missing from the checkpoint")
                v = np.stack([np.asarray(a) for a in v])
            v = np.asarray(v).astype(aval.dtype)
        elif isinstance(var, nnx.Param) and not any(path[:len(m)] == m for m in allow_missing):
            raise ValueError(f"parameter {'.'.join(map(str, path))} not found in the checkpoint")
        elif isinstance(var, nnx.Param):
            v = np.asarray(jax.random.normal(jax.random.key(0), aval.shape, jnp.float32) * 0.02,
                           aval.dtype)
        else:  # bookkeeping state (MoE statistics): zeros
            v = np.zeros(aval.shape, aval.dtype)
        if mesh is None:
            v = jnp.asarray(v)
        else:
            names = variable_axes(var)
            spec = (spec_for(".".join(map(str, path)), names, v.shape, mesh, lrules)
                    if names and len(names) == v.ndim else jax.sharding.PartitionSpec())
            v = jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
        out.append((path, var.replace(v)))
    model = nnx.merge(graphdef, nnx.from_flat_state(out))
    model.eval()
    return model


# --------------------------------------------------------------------------- #
# Public entry points.
# --------------------------------------------------------------------------- #


class HFEncoder(nnx.Module):
    """A BERT checkpoint called as transformers calls it:
    `model(input_ids, token_type_ids=None, attention_mask=None) -> MLM logits [B,T,V]`,
    `model.pooled_output(...) -> [B, D]` (when the checkpoint has the pooler)."""

    def __init__(self, model: EncoderModel, has_pooler: bool):
        self.model = model
        self.config = model.config
        self.has_pooler = has_pooler

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None):
        return self.model(input_ids, token_type_ids, attention_mask)

    def encode(self, input_ids, token_type_ids=None, attention_mask=None):
        return self.model.encode(input_ids, token_type_ids, attention_mask)

    def pooled_output(self, input_ids, token_type_ids=None, attention_mask=None):
        if not self.has_pooler:
            raise ValueError("this checkpoint has no pooler (bert.pooler.dense); save it from "
                             "BertModel / BertForPreTraining to get pooled outputs")
        return self.model.pool(self.encode(input_ids, token_type_ids, attention_mask))


def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(file):
        raise ValueError(f"path: {path!r} is not a checkpoint directory with config.json "
                         "(as transformers' save_pretrained writes)")
    try:
        with open(file, "rb") as f:
            hf = json.load(f)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{file}: not valid JSON ({e}); fix the file or re-save the checkpoint "
                         "with transformers' save_pretrained") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file}: holds {type(hf).__name__}, not the JSON object of a model "
                         "config; re-save the checkpoint with transformers' save_pretrained")
    return hf


def config_from_hf(hf: dict, *, dtype: str | None = None,
                   source: str = "config.json") -> ModelConfig:
    """The tfjax `ModelConfig` of an HF config dict. Unsupported options raise
    NotImplementedError; a key of the wrong JSON type (`hf_config.check_types`) or a
    missing key the family needs is a ValueError naming `source` (the file) and the key."""
    hf_config.check_types(hf, source)
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type, field=f"{source} model_type")
    try:
        c = family.config(hf)
    except KeyError as e:  # the mappings read the keys a family cannot do without as hf[key]
        raise ValueError(f"{source}: no key {e.args[0]!r}, which model_type={model_type!r} "
                         f"needs; add it to {source} (save_pretrained writes every key)") from None
    name = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        name = str(jnp.dtype(name))
    except TypeError:
        pass
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not a model dtype; use float32, bfloat16 or float16")
    c.update(dtype=name, param_dtype=name)
    return check_names(model_config(c))


def load(path: str, *, dtype: str | None = None, mesh=None, rules=DEFAULT_RULES):
    """`(model, config)` from a local HF checkpoint directory.

    dtype: compute and parameter dtype (default: the checkpoint's `dtype`).
    mesh: a `jax.sharding.Mesh`; each parameter is placed with the sharding its
      logical axes give under `rules` (default `tfjax.config.DEFAULT_RULES`).
    Causal LMs come back as `DecoderLM` (`model(input_ids) -> logits [B,T,V]`, usable
    with `tfjax.inference.generate`); BERT as `HFEncoder`; T5 as `EncoderDecoderModel`
    (`model(input_ids, decoder_input_ids) -> logits`).
    """
    hf = _read_config(path)
    cfg = config_from_hf(hf, dtype=dtype, source=os.path.join(path, "config.json"))
    family = FAMILIES.get(hf["model_type"], field="config.json model_type")
    prefix = PREFIXES.get(hf["model_type"])
    w = Weights(SafetensorsCheckpoint(path), (prefix,) if prefix else ())
    arrays = family.weights(w, cfg, hf)
    left = w.leftovers()
    if left:
        raise NotImplementedError(
            f"{path}: checkpoint tensors not used by the {hf['model_type']} mapping (a feature "
            f"tfjax.interop.hf does not support?): {', '.join(left[:8])}"
            f"{' ...' if len(left) > 8 else ''}")
    if hf["model_type"] == "bert":
        has_pooler = ("pooler", "kernel") in arrays
        model = load_state(arrays, cfg, mesh=mesh, rules=rules,
                           allow_missing=() if has_pooler else (("pooler",),))
        return HFEncoder(model, has_pooler), cfg
    return load_state(arrays, cfg, mesh=mesh, rules=rules), cfg


# --------------------------------------------------------------------------- #
# Export (Llama family).
# --------------------------------------------------------------------------- #


def _check_llama_exportable(cfg: ModelConfig) -> None:
    want = dict(arch="decoder", norm="rmsnorm", norm_placement="pre", block="sequential",
                position="rope", activation="swiglu", qk_norm=False, attn_softcap=0.0,
                final_softcap=0.0, scale_embeddings=False, embed_norm=False, logits_scale=1.0,
                layer_pattern=("global",), ffn_pattern=("dense",), prefix_lm=False,
                attention_sinks=False, v_head_dim=0)
    for field, value in want.items():
        if getattr(cfg, field) != value:
            raise ValueError(f"export: model.{field}={getattr(cfg, field)!r} has no Llama "
                             f"equivalent (needs {value!r})")
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError("export: Llama's attention_bias covers q, k, v and o together; "
                         f"got qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}")
    if cfg.rope.layout != "half" or cfg.rope.fraction != 1.0:
        raise ValueError("export: Llama uses rope.layout='half' and rope.fraction=1.0")
    if cfg.attn_scale and abs(cfg.attn_scale - cfg.head_size ** -0.5) > 1e-12:
        raise ValueError(f"export: attn_scale={cfg.attn_scale} is not 1/sqrt(head_dim)")


def _rope_parameters(r) -> dict:
    out: dict[str, Any] = {"rope_theta": r.theta, "rope_type": "default"}
    if r.scaling == "linear":
        out.update(rope_type="linear", factor=r.factor)
    elif r.scaling == "llama3":
        out.update(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                   high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_len)
    elif r.scaling == "yarn":
        out.update(rope_type="yarn", factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                   original_max_position_embeddings=r.original_max_len,
                   attention_factor=0.1 * r.mscale * math.log(r.factor) + 1.0)
    elif r.scaling != "none":
        raise ValueError(f"export: rope.scaling={r.scaling!r} is not exported (none, linear, "
                         "llama3, yarn are)")
    return out


def export(model: nnx.Module, path: str, *, dtype: str | None = None, tokenizer=None) -> None:
    """Write a Llama-family tfjax decoder as an HF checkpoint (`config.json` +
    `model.safetensors`) that `transformers.LlamaForCausalLM.from_pretrained` loads.

    tokenizer: the run's tokenizer (`tfjax.data.load_tokenizer(cfg.data.tokenizer)`,
      as `tfjax.generate.load_run` returns it). Given, the directory also gets its
      `tokenizer.json` (`hf_tokenizer()`: encoding puts BOS first, as training did) and
      `tokenizer_config.json` (for transformers' `AutoTokenizer`), and its bos / eos /
      pad ids go into `config.json` and `generation_config.json`, so that
      `python -m tfjax.generate --hf PATH` (and HF `generate`) stop at its EOS. The byte
      tokenizer and `tokenizers` JSON files are written; a sentencepiece model is a
      ValueError (export without it). Everything is checked before anything is written.
    """
    cfg: ModelConfig = model.config
    _check_llama_exportable(cfg)
    if tokenizer is not None:
        hf_tok = tokenizer.hf_tokenizer()
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"export: the tokenizer has {tokenizer.vocab_size} ids but "
                             f"model.vocab_size is {cfg.vocab_size}; pass the run's own tokenizer")
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))

    def get(key):
        p, idx = _target(cfg, key)
        a = np.asarray(jax.device_get(flat[p]))
        return a if idx is None else a[idx]

    N, K, H, D = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.d_model
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": get(("embed", "tokens", "embedding")),
                                "model.norm.weight": get(("final_norm", "scale"))}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = get(("embed", "head", "kernel")).T
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        for ours, theirs, heads in (("q", "q_proj", N), ("k", "k_proj", K), ("v", "v_proj", K)):
            t[f"{p}self_attn.{theirs}.weight"] = get(L + ("attn", ours, "kernel")).reshape(D, heads * H).T
            if cfg.qkv_bias:
                t[f"{p}self_attn.{theirs}.bias"] = get(L + ("attn", ours, "bias")).reshape(-1)
        t[f"{p}self_attn.o_proj.weight"] = get(L + ("attn", "o", "kernel")).reshape(N * H, D).T
        if cfg.out_bias:
            t[f"{p}self_attn.o_proj.bias"] = get(L + ("attn", "o", "bias"))
        t[f"{p}input_layernorm.weight"] = get(L + ("attn_norm", "scale"))
        t[f"{p}post_attention_layernorm.weight"] = get(L + ("ffn_norm", "scale"))
        for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
            t[f"{p}mlp.{theirs}.weight"] = get(L + ("ffn", ours, "kernel")).T
            if cfg.ffn_bias:
                t[f"{p}mlp.{theirs}.bias"] = get(L + ("ffn", ours, "bias"))
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(out_dtype)) for k, v in t.items()},
              os.path.join(path, "model.safetensors"))
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
              hidden_size=D, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_layers,
              num_attention_heads=N, num_key_value_heads=K, head_dim=H, hidden_act="silu",
              max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias,
              mlp_bias=cfg.ffn_bias, rope_parameters=_rope_parameters(cfg.rope),
              dtype=str(out_dtype), attention_dropout=0.0)
    if tokenizer is not None:
        ids = dict(bos_token_id=int(tokenizer.bos_id), eos_token_id=int(tokenizer.eos_id),
                   pad_token_id=int(tokenizer.pad_id))
        hf.update(ids)
        hf_tok.save(os.path.join(path, "tokenizer.json"))
        name = hf_tok.id_to_token
        tok_cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=name(tokenizer.bos_id),
                       eos_token=name(tokenizer.eos_id), pad_token=name(tokenizer.pad_id),
                       model_max_length=cfg.max_len)
        for file, content in (("generation_config.json", ids),
                              ("tokenizer_config.json", tok_cfg)):
            with open(os.path.join(path, file), "w") as f:
                json.dump(content, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)

