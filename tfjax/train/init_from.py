"""Fine-tuning: a run that starts from a checkpoint (`--config.init_from=DIR`), a Hugging
Face checkpoint directory or a tfjax training workdir (the parameters of its newest
checkpoint that restores; not its optimizer state, step or data position).

`resolve_init_from(cfg)` takes the model from the checkpoint (`merge_model`: the
config's `RUNTIME_FIELDS` win, and with `context_extension` its `CONTEXT_FIELDS` too;
any other field the config sets must agree, else a ValueError naming it);
`check_tokenizer` refuses a tokenizer larger than the checkpoint's vocabulary;
`initial_state` reads the weights, only when WORKDIR has no checkpoint of its own (with
LoRA they become the frozen base). Every check runs before anything compiles. See docs/training.md ("Fine-tuning").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from tfjax import storage
from tfjax.config import (ModelConfig, RopeConfig, RunConfig, flat_fields, model_config,
                          run_config, upgrade_saved)
from tfjax.data.tokenizer import TOKENIZER_FILES
from tfjax.interop import hf
from tfjax.interop.safetensors_io import SafetensorsCheckpoint
from tfjax.interop.tensor_mapping import Weights
from tfjax.models import build
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.train.checkpoint import Checkpointer, abstract_with_shardings, read_json_object
from tfjax.train.lora import model_params, train_state_shape
from tfjax.train.program import Program

__all__ = ["CONTEXT_FIELDS", "RUNTIME_FIELDS", "check_tokenizer", "checkpoint_kind",
           "initial_state", "load_teacher", "merge_model", "resolve_init_from", "teacher_config"]

# How the model runs, not what it is: always the config file's (docs/training.md).
RUNTIME_FIELDS = ("dtype", "param_dtype", "attention.impl", "attention.context_parallel",
                  "attention.zigzag", "attention.ulysses_size", "remat", "dropout_rate",
                  "init_std", "moe.impl")

# What a context extension may change (`RunConfig.context_extension`): the RoPE
# frequencies and the length the model is built for, as Hugging Face's
# `from_pretrained(..., rope_scaling=..., max_position_embeddings=...)` does; the
# parameters stay the same shapes. `max_len` sizes a learned table: not for those.
CONTEXT_FIELDS = ("max_len",) + tuple(f"rope.{f.name}" for f in dataclasses.fields(RopeConfig)
                                      if f.name not in ("fraction", "layout"))


def checkpoint_kind(path: str) -> str:
    """"hf" (config.json + safetensors) or "tfjax" (a training workdir: config.json +
    checkpoints/); anything else is a ValueError naming `init_from` and the fix."""
    fix = ("point --config.init_from at a Hugging Face checkpoint directory (config.json + "
           "*.safetensors, as save_pretrained writes) or at a tfjax training --workdir "
           "(config.json + checkpoints/)")
    if path:
        storage.check_reachable(path, "init_from")  # a bucket: one line naming the fix
    if not path or not storage.path(path).is_dir():
        raise ValueError(f"init_from: {path!r} is not a directory; {fix}")
    where = storage.path(path)
    has_config = (where / "config.json").is_file()
    steps = where / "checkpoints"
    if has_config and steps.is_dir():
        if not any(d.name.isdigit() for d in steps.iterdir()):
            raise ValueError(f"init_from: {path} is a tfjax workdir without a finished "
                             f"checkpoint under {os.path.join(path, 'checkpoints')}; let that "
                             f"run save one (every checkpoint.every_steps and at its end), or "
                             f"point init_from elsewhere")
        return "tfjax"
    if has_config and any(where.glob("*.safetensors")):
        return "hf"
    found = sorted(p.name for p in where.iterdir())[:6]
    raise ValueError(f"init_from: {path} is not a checkpoint (it holds "
                     f"{', '.join(found) or 'nothing'}): no config.json with *.safetensors and "
                     f"no tfjax checkpoints/ directory; {fix}")


def _source(path: str) -> tuple[str, ModelConfig, str | None, Any]:
    """(kind, the checkpoint's model config, its tokenizer or None, its HF dict or
    its RunConfig)."""
    kind = checkpoint_kind(path)
    config = os.path.join(path, "config.json")
    if kind == "hf":
        d = read_json_object(config, "init_from", "a model config")
        try:
            m = hf.config_from_hf(d, source=config)
        except NotImplementedError as e:
            raise ValueError(f"init_from: {e}") from None
        has_tok = any((storage.path(path) / f).is_file() for f in TOKENIZER_FILES)
        return kind, m, path if has_tok else None, d  # load_tokenizer(path) reads it
    src = run_config(upgrade_saved(read_json_object(config, "init_from", "a run config")))
    return kind, src.model, src.data.tokenizer, src


def merge_model(mine: ModelConfig, theirs: ModelConfig, where: str, *,
                extend: bool = False) -> ModelConfig:
    """The checkpoint's model config `theirs` with the run-time fields of `mine` (and
    with `extend`, a context extension, its `CONTEXT_FIELDS`); a field `mine` sets
    away from the default that disagrees with `theirs` is a ValueError naming it
    (`where`: the checkpoint, for the message)."""
    a, b, default = flat_fields(mine), flat_fields(theirs), flat_fields(ModelConfig())
    out = dict(b)
    for k, v in a.items():
        if k in RUNTIME_FIELDS:
            out[k] = v
        elif v == default[k] or v == b[k]:
            continue
        elif k in CONTEXT_FIELDS and extend:
            if k == "max_len" and theirs.position == "learned":
                raise ValueError(f"model.max_len: the checkpoint init_from={where} has a "
                                 f"learned position table of {b[k]} rows, which a context "
                                 f"extension cannot resize; drop --config.model.max_len")
            if k.startswith("rope.") and theirs.position != "rope":
                raise ValueError(f"model.{k}: the checkpoint init_from={where} has "
                                 f"position={theirs.position!r}, not RoPE; drop "
                                 f"--config.model.{k}")
            out[k] = v
        elif k in CONTEXT_FIELDS:
            raise ValueError(f"model.{k}: the config sets {v!r}, but the checkpoint init_from="
                             f"{where} has {b[k]!r}; to continue it at a longer context with "
                             f"this RoPE setting set --config.context_extension=True, else drop "
                             f"--config.model.{k}")
        else:
            raise ValueError(f"model.{k}: the config sets {v!r}, but the checkpoint init_from="
                             f"{where} has {b[k]!r}, and a fine-tune takes its model from the "
                             f"checkpoint; drop --config.model.{k} (or set it to {b[k]!r})")
    nested: dict[str, Any] = {}
    for k, v in out.items():
        *sections, name = k.split(".")
        d = nested
        for s in sections:
            d = d.setdefault(s, {})
        d[name] = v
    return model_config(nested)


def resolve_init_from(cfg: RunConfig) -> RunConfig:
    """`cfg` with its model taken from `cfg.init_from` (`merge_model`) and
    `data.tokenizer="init_from"` replaced by the checkpoint's tokenizer; `cfg` itself
    when `init_from` is empty."""
    if not cfg.init_from:
        return cfg
    kind, theirs, tok, _ = _source(cfg.init_from)
    data = cfg.data
    if data.tokenizer == "init_from":
        if tok is None:
            raise ValueError(f"data.tokenizer: 'init_from', but {cfg.init_from} has neither "
                             f"tokenizer.json nor tokenizer.model; put the model's tokenizer "
                             f"there or name one with --config.data.tokenizer=PATH")
        data = dataclasses.replace(data, tokenizer=tok)
    model = merge_model(cfg.model, theirs, cfg.init_from, extend=cfg.context_extension)
    return dataclasses.replace(cfg, model=model, data=data).validate()


def check_tokenizer(cfg: RunConfig, tokenizer) -> None:
    """A fine-tune's tokenizer must fit the checkpoint's vocabulary (ValueError)."""
    if cfg.init_from and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"data.tokenizer: {cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids, more than "
            f"the checkpoint's vocabulary (vocab_size {cfg.model.vocab_size}, init_from="
            f"{cfg.init_from}); use the checkpoint's own tokenizer: "
            f"--config.data.tokenizer=init_from")


def _hf_params(path: str, hf_dict: dict, m: ModelConfig, mesh, rules):
    """The parameters of an HF checkpoint as the tfjax model of `m` holds them, each
    read from the memory-mapped files and put on `mesh` by its logical axes."""
    model_type = hf_dict["model_type"]
    family = hf.FAMILIES.get(model_type, field="init_from config.json model_type")
    # safetensors are memory-mapped: from a bucket, a local copy of them first
    local = storage.local_directory(path, ("*.safetensors", "*.safetensors.index.json"))
    w = Weights(SafetensorsCheckpoint(local), (family.prefix,) if family.prefix else ())
    arrays = family.weights(w, m, hf_dict)
    if left := w.leftovers():
        raise ValueError(f"init_from: {path} has tensors the {model_type} mapping does not "
                         f"read: {', '.join(left[:8])}")
    allow = (("pooler",),) if model_type == "bert" and ("pooler", "kernel") not in arrays else ()
    model = hf.load_state(arrays, m, mesh=mesh, rules=rules, allow_missing=allow)
    return nnx.split(model, nnx.Param, ...)[1]


def _tfjax_params(path: str, src: RunConfig, mesh, rules, log):
    """The parameters of the newest checkpoint of a tfjax run that restores, placed
    on `mesh` by `rules` (as the fine-tune's own program places them)."""
    def make_model():
        with nnx.use_eager_sharding(False):
            return build(src.model, rngs=nnx.Rngs(src.seed))

    _, aparams, arest = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
    astate, lora, _ = train_state_shape(src, aparams, arest)  # a LoRA run: base + adapters
    ckpt = Checkpointer(path, dataclasses.replace(src.checkpoint, async_save=False))
    try:
        astate = ckpt.with_saved_reference(astate)  # a dpo / distill run's frozen model
        abstract = abstract_with_shardings(astate, tree_shardings(astate, mesh, rules, []))
        got = ckpt.restore(abstract, warn=lambda s: log(f"  warning: init_from: {s}"))
    finally:
        ckpt.close()
    if got is None:
        raise ValueError(f"init_from: {path} has no finished checkpoint under "
                         f"{os.path.join(path, 'checkpoints')}; let that run save one, or point "
                         f"init_from elsewhere")
    state, _, step = got
    return model_params(lora, state), step  # a LoRA run's base merged with its adapters


def initial_state(program: Program, cfg: RunConfig, mesh, log: Callable[[str], None]) -> dict:
    """The fine-tune's step-0 state on `program`'s shardings (`tfjax.train.program`, the
    run `cfg` on `mesh`): parameters from `cfg.init_from` cast to `model.param_dtype`, a
    fresh optimizer state, and the rest of the model state (RNG counters, ...) of a
    fresh init; `log` gets one line saying where the parameters came from."""
    path = cfg.init_from
    kind, _, _, source = _source(path)
    sh = program.state_shardings
    base = "frozen" if program.lora else "params"  # LoRA: the checkpoint is the frozen base
    aparams = program.abstract_state[base]
    if kind == "hf":
        loaded = _hf_params(path, source, cfg.model, mesh, cfg.mesh.rules)
        where = f"Hugging Face {source['model_type']}"
    else:
        loaded, step = _tfjax_params(path, source, mesh, logical_rules(cfg.mesh.rules), log)
        where = f"step {step} of the tfjax run"
    if jax.tree.structure(loaded) != jax.tree.structure(aparams):
        raise ValueError(f"init_from: the parameters in {path} do not form the tree of "
                         f"this run's model (check model.scan_layers and the layer layout)")
    pairs = zip(jax.tree_util.tree_leaves_with_path(loaded), jax.tree.leaves(aparams))
    bad = [f"{jax.tree_util.keystr(p)}: {x.shape} != {a.shape}" for (p, x), a in pairs
           if x.shape != a.shape]
    if bad:
        raise ValueError(f"init_from: parameter shapes differ from this run's model: {bad[0]}")
    # onto the program's shardings (a no-op where the placement already agrees)
    loaded = jax.device_put(loaded, sh[base])

    def combine(params, rest):
        params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, aparams)
        return program.start(params, rest)  # fresh optimizer (and LoRA adapters)

    fresh = program.init()
    state = jax.jit(combine, in_shardings=(sh[base], sh["rest"]), out_shardings=sh)(
        loaded, fresh["rest"])
    log(f"  init_from: {program.num_params / 1e6:.2f}M parameters from {path} ({where}); "
        f"optimizer state fresh")
    return state


def teacher_config(cfg: RunConfig) -> ModelConfig | None:
    """The model config of `train.teacher` (read as `init_from` reads a checkpoint), with
    the student's dtypes; None without a teacher. A vocabulary other than the
    student's is a ValueError naming `train.teacher`."""
    path = cfg.train.teacher
    if not path:
        return None
    try:
        _, m, _, _ = _source(path)
    except ValueError as e:
        raise ValueError(f"train.teacher: {str(e).replace('init_from', 'the teacher')}") from None
    if m.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"train.teacher: {path} has vocab_size {m.vocab_size}, the student "
                         f"model.vocab_size {cfg.model.vocab_size}; distillation compares "
                         f"logits over one vocabulary: use a teacher with the student's "
                         f"tokenizer and vocabulary")
    return dataclasses.replace(m, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)


def load_teacher(program: Program, cfg: RunConfig, mesh, state: dict,
                 log: Callable[[str], None]) -> dict:
    """`state` with `state["reference"]["params"]` read from `train.teacher` (a fresh
    run's; a resumed run restores the teacher with its checkpoint)."""
    path, m = cfg.train.teacher, teacher_config(cfg)
    kind, _, _, source = _source(path)
    rules = logical_rules(cfg.mesh.rules)
    if kind == "hf":
        loaded = _hf_params(path, source, m, mesh, cfg.mesh.rules)
    else:
        loaded, _ = _tfjax_params(path, source, mesh, rules, log)
    want = program.abstract_state["reference"]["params"]
    sh = program.state_shardings["reference"]["params"]
    loaded = jax.tree.map(lambda x, a: x.astype(a.dtype), loaded, want)
    log(f"  teacher: {sum(x.size for x in jax.tree.leaves(loaded)) / 1e6:.2f}M parameters "
        f"from {path}")
    return dict(state, reference=dict(state["reference"], params=jax.device_put(loaded, sh)))
