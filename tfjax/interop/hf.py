"""Hugging Face checkpoints in and out of tfjax, with logit parity.

    model, cfg = tfjax.interop.hf.load("path/to/checkpoint")       # config.json + *.safetensors
    logits = model(input_ids)                                       # causal LMs: [B, T, V]
    tfjax.interop.hf.export(model, "out/")                          # any family -> HF

Each supported `model_type` is a `Family` in `FAMILIES`, the one table of the family
modules (`tfjax.interop.families`). `load` places layer i where the stack's layout
says, checks every shape, casts to `dtype` and, with a `mesh`, shards; `export` picks
the family that holds the model exactly and runs its weights mapping backwards
(`tfjax.interop.hf_invert`). See docs/interop.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax.config import DEFAULT_RULES, DTYPES, ModelConfig, model_config
from tfjax.interop.computation import config_diff
from tfjax.interop.config_mapping import check_types
from tfjax.interop.families import (Family, bert, bloom, deepseek_v3, gemma2, gemma3, gemma3_text,
                                    gpt2, gpt_neox, gpt_oss, jamba, llama, llama4, mamba, mamba2,
                                    mixtral, mllama, modernbert, olmo2, paligemma, phi3, qwen2,
                                    qwen3, qwen3_moe, qwen3_next, siglip, smollm3, t5,
                                    whisper, zamba2)
from tfjax.interop.hf_invert import Inverse, Symbolic, hf_shapes, stack, symbolic_checkpoint
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, write_file
from tfjax.interop.tensor_mapping import Weights
from tfjax.models import (EncoderModel, ImagePrefixLM, StackLayout, build, check_names,
                          model_class)
from tfjax.models.vision import tower_config
from tfjax.parallel.rules import logical_rules, spec_for, variable_axes
from tfjax.registry import Registry

__all__ = ["FAMILIES", "Family", "HFEncoder", "config_from_hf", "export", "load", "load_state"]

# Every checkpoint family tfjax reads: one record per module of tfjax.interop.families
# (nothing registers itself), under each `model_type` it answers to.
FAMILIES: Registry[Family] = Registry("Hugging Face model_type", {
    model_type: module.FAMILY for module in (
        llama, qwen3, mixtral, gemma2,  # Llama's layout (and Mistral) and its first kin
        qwen2, olmo2, smollm3, gemma3_text, phi3, qwen3_moe,  # Llama-like, 2024-25
        gpt_oss, llama4, deepseek_v3,  # MoE decoders
        gpt2, gpt_neox, bloom,  # fused QKV, LayerNorm
        bert, modernbert,  # encoders
        t5,  # encoder-decoder
        whisper,  # speech encoder-decoder (log-mel features in)
        mllama,  # vision-language: cross-attention layers to image features
        mamba, mamba2, qwen3_next, jamba, zamba2,  # recurrent and hybrid
        siglip, paligemma, gemma3,  # vision, vision-language
    ) for model_type in module.FAMILY.model_types})


# --------------------------------------------------------------------------- #
# Placement: per-layer arrays -> the (scanned) parameter tree.
# --------------------------------------------------------------------------- #


def _layouts(cfg: ModelConfig) -> dict[tuple, StackLayout]:
    """The model's layer stacks by path, with their layouts."""
    if cfg.arch == "encoder_decoder":
        return {("encoder",): StackLayout.of(cfg, cfg.encoder_layers),
                ("decoder",): StackLayout.of(cfg, cfg.num_layers)}
    out = {("layers",): StackLayout.of(cfg)}
    if model_class(cfg) is ImagePrefixLM:  # its image tower (PaliGemma)
        out[("vision", "layers")] = StackLayout.of(tower_config(cfg))
    return out


def _target(cfg: ModelConfig, key: tuple) -> tuple[tuple, int | None]:
    """Our per-layer key `(*stack, i, ...)` -> (state path, index in the scanned stack)."""
    for stack, layout in _layouts(cfg).items():
        n = len(stack)
        if key[:n] != stack or len(key) <= n or not isinstance(key[n], int):
            continue
        i, rest = key[n], key[n + 1:]
        where = layout.where(i)
        if where[0] == "cycles":
            _, j, c = where
            return (*stack, "cycles", "layers", j, *rest), c
        return (*stack, "blocks", where[1], *rest), None
    return key, None


def _abstract(cfg: ModelConfig):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))


def _place_blocks(sym: Symbolic, dtype, sharding, tensor: Callable[[str], np.ndarray]):
    """The jax array of `sym` (an expression over the checkpoint's tensors) in `dtype`
    with `sharding`, built one device block at a time: each distinct block (devices
    that replicate it share one) is read from `tensor(name)` (memory-mapped), cast,
    put on its devices and let go before the next."""
    shape = sym.shape
    blocks: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))
        blocks.setdefault(key, []).append(device)
    shards = []
    for key, devices in blocks.items():
        block = sym.block(tuple(slice(a, b) for a, b in key), tensor, dtype)
        placed = [jax.device_put(block, d) for d in devices]
        shards += jax.block_until_ready(placed)  # the copies done before the block goes
        del block
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def load_state(arrays: dict, cfg: ModelConfig, *, mesh=None, rules=DEFAULT_RULES,
               allow_missing: tuple[tuple, ...] = (),
               tensor: Callable[[str], np.ndarray] | None = None) -> nnx.Module:
    """Build the model of `cfg` with its parameters from `arrays` (`{our key: array}`,
    per-layer keys `(stack, i, ...)`), cast to `cfg.param_dtype`, on `mesh` if given.
    Every parameter must be given (except paths in `allow_missing`, left at init).

    tensor: with a `mesh`, `arrays` may instead hold `hf_invert.Symbolic` expressions
      over checkpoint tensors, `tensor(name)` giving each (memory-mapped): every
      parameter is then built device block by device block (`_place_blocks`), never
      whole in host memory, with the same values as from the arrays."""
    if tensor is not None and mesh is None:
        raise ValueError("load_state: tensor= (symbolic arrays) needs a mesh; without one "
                         "pass the arrays themselves")
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
        sharding = None
        if mesh is not None:
            names = variable_axes(var)
            spec = (spec_for(".".join(map(str, path)), names, aval.shape, mesh, lrules)
                    if names and len(names) == aval.ndim else jax.sharding.PartitionSpec())
            sharding = jax.sharding.NamedSharding(mesh, spec)
        if path in values:
            v = values[path]
            if isinstance(v, list):
                if any(a is None for a in v):
                    raise ValueError(f"{path}: layers missing from the checkpoint")
                v = stack(v) if tensor is not None else np.stack([np.asarray(a) for a in v])
            if tensor is not None:
                out.append((path, var.replace(_place_blocks(v, aval.dtype, sharding, tensor))))
                continue
            v = np.asarray(v).astype(aval.dtype)
        elif isinstance(var, nnx.Param) and not any(path[:len(m)] == m for m in allow_missing):
            raise ValueError(f"parameter {'.'.join(map(str, path))} not found in the checkpoint")
        elif isinstance(var, nnx.Param):
            v = np.asarray(jax.random.normal(jax.random.key(0), aval.shape, jnp.float32) * 0.02,
                           aval.dtype)
        else:  # bookkeeping state (MoE statistics): zeros
            v = np.zeros(aval.shape, aval.dtype)
        v = jnp.asarray(v) if mesh is None else jax.device_put(v, sharding)
        out.append((path, var.replace(v)))
    model = nnx.merge(graphdef, nnx.from_flat_state(out))
    model.eval()
    return model


# --------------------------------------------------------------------------- #
# Public entry points.
# --------------------------------------------------------------------------- #


class HFEncoder(nnx.Module):
    """A BERT / ModernBERT checkpoint called as transformers calls it:
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
    NotImplementedError; a key of the wrong JSON type (`config_mapping.check_types`) or a
    missing key the family needs is a ValueError naming `source` (the file) and the key."""
    check_types(hf, source)
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


def load(path: str, *, dtype: str | None = None, mesh=None, rules=DEFAULT_RULES,
         scan_layers: bool = True):
    """`(model, config)` from a local HF checkpoint directory.

    dtype: compute and parameter dtype (default: the checkpoint's `dtype`).
    scan_layers: stack the layers' parameters and scan them (compile time flat in
      depth: training, scoring); False places every layer as an unrolled block, whose
      decode steps update their caches in place (`tfjax.models.unrolled`).
    mesh: a `jax.sharding.Mesh`; each parameter is placed with the sharding its
      logical axes give under `rules` (default `tfjax.config.DEFAULT_RULES`), built
      from the memory-mapped checkpoint one device block at a time (host memory: a
      few device blocks, not the model nor a whole parameter; same values as without).
    Causal LMs come back as `DecoderLM` (`model(input_ids) -> logits [B,T,V]`, usable
    with `tfjax.inference.generate`); BERT as `HFEncoder`; T5 as `EncoderDecoderModel`
    (`model(input_ids, decoder_input_ids) -> logits`).
    """
    hf = _read_config(path)
    cfg = config_from_hf(hf, dtype=dtype, source=os.path.join(path, "config.json"))
    cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    family = FAMILIES.get(hf["model_type"], field="config.json model_type")
    ckpt = SafetensorsCheckpoint(path)
    if family.build is not None:  # not build(cfg)'s model (mllama: vision + text)
        if mesh is not None:
            raise NotImplementedError(f"{path}: model_type {hf['model_type']!r} loads on one "
                                      "device; pass mesh=None")
        return family.build(hf, ckpt, scan_layers=scan_layers, dtype=cfg.dtype), cfg
    depth = family.mtp_depth(hf, ckpt) if family.mtp_depth is not None else 0
    if depth:  # the checkpoint's multi-token-prediction modules (DeepSeek-V3, Qwen3-Next)
        cfg = dataclasses.replace(cfg, mtp_depth=depth)
    lazy = mesh is not None  # the mapping runs on the tensors' names and shapes alone
    source = symbolic_checkpoint({n: ckpt.shape(n) for n in ckpt}) if lazy else ckpt
    w = Weights(source, (family.prefix,) if family.prefix else ())
    arrays = family.weights(w, cfg, hf)
    left = w.leftovers()
    if left:
        raise NotImplementedError(
            f"{path}: checkpoint tensors not used by the {hf['model_type']} mapping (a feature "
            f"tfjax.interop.hf does not support?): {', '.join(left[:8])}"
            f"{' ...' if len(left) > 8 else ''}")
    tensor = ckpt.__getitem__ if lazy else None
    if cfg.arch == "encoder":  # BERT, ModernBERT
        has_pooler = ("pooler", "kernel") in arrays
        model = load_state(arrays, cfg, mesh=mesh, rules=rules, tensor=tensor,
                           allow_missing=() if has_pooler else (("pooler",),))
        return HFEncoder(model, has_pooler), cfg
    return load_state(arrays, cfg, mesh=mesh, rules=rules, tensor=tensor), cfg


# --------------------------------------------------------------------------- #
# Export: every family with a `to_hf`.
# --------------------------------------------------------------------------- #


def _exportable(cfg: ModelConfig, family: str | None) -> tuple[str, Family, dict]:
    """`(model_type, family, config.json dict)` for `cfg`: the family named, or the
    first family by name whose `to_hf` -> `config` round trip gives `cfg` back (in every
    field of `tfjax.interop.computation.computation`); else a one-line ValueError naming
    each field where the closest family differs."""
    if family is not None and FAMILIES.get(family, field="export family").to_hf is None:
        raise ValueError(f"export: model_type {family!r} is read but not written (its Family "
                         f"has no to_hf); exportable: {', '.join(_writable())}")
    tried, seen = [], set()
    for name in [family] if family is not None else list(FAMILIES):
        fam = FAMILIES.get(name)
        if fam.to_hf is None or id(fam) in seen:
            continue
        seen.add(id(fam))
        try:
            hf = fam.to_hf(cfg)
            diff = config_diff(cfg, config_from_hf(hf, dtype="float32", source=f"{name} config"),
                               name)
            rank = len(diff)
        except (ValueError, NotImplementedError, KeyError, TypeError) as e:
            diff, rank = [f"{type(e).__name__}: {e}"], math.inf  # not a near miss
        if not diff:
            return hf["model_type"], fam, hf
        tried.append((rank, name, diff))
    _, name, diff = min(tried)
    where = (f"model_type {family!r} cannot hold this model" if family is not None else
             f"no Hugging Face family holds this model (the closest is {name})")
    raise ValueError(f"export: {where}: {'; '.join(diff)}")


def _check_llama_exportable(cfg: ModelConfig) -> None:
    """A ValueError naming each field where `cfg` is not a Llama / Mistral, whose module
    names (`q_proj`, `down_proj`, ...) `tfjax.train.lora.write_peft` writes adapters under."""
    _exportable(cfg, "llama")


def _writable() -> list[str]:
    return [n for n in FAMILIES if FAMILIES.get(n).to_hf is not None]


def export(model: nnx.Module, path: str, *, family: str | None = None, dtype: str | None = None,
           tokenizer=None) -> None:
    """Write a tfjax model as an HF checkpoint (`config.json` + `model.safetensors`) that
    transformers' `from_pretrained` (and `load`) reads: any model of a family with a
    `to_hf` (every family `load` reads, listed in `FAMILIES`).

    family: the HF `model_type` to write; None: the first family, by name, that holds
      the model exactly. A model no family holds (ALiBi with SwiGLU, a layer pattern
      the family lacks, ...) is a ValueError naming each differing `model.` field.
    dtype: the dtype on disk (default `model.param_dtype`).
    tokenizer: the run's tokenizer (`tfjax.data.load_tokenizer(cfg.data.tokenizer)`,
      as `tfjax.train.checkpoint.load_run` returns it). Given, the directory also gets its
      `tokenizer.json` (`hf_tokenizer()`: encoding puts BOS first, as training did) and
      `tokenizer_config.json` (for transformers' `AutoTokenizer`), and its bos / eos /
      pad ids go into `config.json` and `generation_config.json`, so that
      `python -m tfjax.generate --hf PATH` (and HF `generate`) stop at its EOS. The byte
      tokenizer and `tokenizers` JSON files are written; a sentencepiece model is a
      ValueError (export without it).

    The tensors are the family's `weights` mapping run backwards
    (`tfjax.interop.hf_invert`): their names and shapes come from transformers' model
    built on the meta device, so export needs the `hf` extra (torch, transformers;
    ImportError without it). Everything is checked before anything is written; the
    file is written one tensor at a time. A BERT `HFEncoder` with its pooler is
    written as `BertForPreTraining` (its NSP head, which tfjax lacks, is left for
    transformers to initialise), any other encoder as `BertForMaskedLM`.
    """
    inner = model.model if isinstance(model, HFEncoder) else model
    cfg: ModelConfig = inner.config
    model_type, fam, hf = _exportable(cfg, family)
    pooler = isinstance(model, HFEncoder) and model.has_pooler and model_type == "bert"
    if pooler:
        hf["architectures"] = ["BertForPreTraining"]
    unwritten = (("pooler",),) if cfg.arch == "encoder" and not pooler else ()
    if tokenizer is not None:
        hf_tok = tokenizer.hf_tokenizer()
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"export: the tokenizer has {tokenizer.vocab_size} ids but "
                             f"model.vocab_size is {cfg.vocab_size}; pass the run's own tokenizer")
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    shapes = hf_shapes(hf)
    inverse = Inverse(fam.weights, cfg, hf, shapes, family=model_type,
                      prefix_aliases=(fam.prefix,) if fam.prefix else ())
    state = dict(nnx.to_flat_state(nnx.state(inner)))  # Params, and state a mapping reads
    flat = {p: v.get_value() for p, v in state.items()}  # (DeepSeek's MoE score bias)
    layers: dict[tuple, set] = {}
    for key, sym in inverse.params.items():
        p, idx = _target(cfg, key)
        if p not in flat:
            raise ValueError(f"export: the {model_type} mapping makes {key}, which this model "
                             f"does not have ({'.'.join(map(str, p))})")
        want = flat[p].shape if idx is None else flat[p].shape[1:]
        if sym.shape != tuple(want):
            raise ValueError(f"export: {key}: {hf['architectures'][0]} gives it shape "
                             f"{sym.shape}, the model has {tuple(want)}")
        layers.setdefault(p, set()).add(idx)
    for p, arr in flat.items():
        if not isinstance(state[p], nnx.Param) or any(p[:len(u)] == u for u in unwritten):
            continue
        if p not in layers or None not in layers[p] and len(layers[p]) != arr.shape[0]:
            raise ValueError(f"export: parameter {'.'.join(map(str, p))} has no place in the "
                             f"{model_type} checkpoint ({hf['architectures'][0]})")
    inverse.check()

    @functools.lru_cache(maxsize=1)
    def value(key):  # our key's array, one layer of a stack at a time
        p, idx = _target(cfg, key)
        return np.asarray(jax.device_get(flat[p] if idx is None else flat[p][idx]))

    os.makedirs(path, exist_ok=True)
    write_file({n: (shapes[n], out_dtype) for n in inverse.written},
               lambda n: inverse.tensor(n, value, out_dtype),
               os.path.join(path, "model.safetensors"))
    hf["dtype"] = str(out_dtype)
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
