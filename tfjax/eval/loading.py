"""What an evaluation reads: a model with its tokenizer and context length (`load_source`
-> `Source`), from a Hugging Face checkpoint directory (`--hf DIR`:
`tfjax.generate.load_hf`; the context is `max_position_embeddings`) or a tfjax training
run (`--workdir W`: `tfjax.train.checkpoint.load_run`; the context is `train.seq_len`).
`check_context` bounds `--context`; `eval_mesh` / `parse_mesh` build the `--mesh`;
`add_eval_flags` / `simulate_cpu_devices`: the flags the evaluation commands share. A
tokenizer with more ids than the model's vocabulary is refused: it belongs to another
model. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable

import jax

from tfjax.config import DEFAULT_RULES, MESH_AXES, MeshConfig
from tfjax.generate import load_hf
from tfjax.parallel.mesh import make_mesh
from tfjax.train.checkpoint import load_run

__all__ = ["Source", "add_eval_flags", "check_context", "eval_mesh", "load_source", "parse_mesh",
           "run_source", "simulate_cpu_devices"]


@dataclasses.dataclass
class Source:
    """A loaded model and how to turn text into its tokens.

    encode(text, specials): ids, with the BOS the model's documents begin with when
    `specials`; decode(ids): text without special tokens."""

    model: object
    encode: Callable[[str, bool], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    context: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    rules: tuple = DEFAULT_RULES
    description: str = ""
    step: int | None = None


def load_source(*, hf: str | None = None, workdir: str | None = None,
                step: int | None = None) -> Source:
    """The model of `--hf DIR` or `--workdir W` (exactly one), checked to fit its tokenizer."""
    if (hf is None) == (workdir is None):
        raise ValueError("give exactly one of --hf DIR (a Hugging Face checkpoint) or "
                         "--workdir W (a tfjax training run)")
    if hf is not None:
        if step is not None:
            raise ValueError("--step is for --workdir runs; an HF checkpoint has one state")
        if not os.path.isdir(hf):
            raise ValueError(f"--hf: {hf} is not a directory; point it at a checkpoint "
                             f"directory (config.json, *.safetensors, tokenizer.json)")
        model, cfg, tok, eos = load_hf(hf)
        n_tok = tok.get_vocab_size(with_added_tokens=True)
        src = Source(model=model,
                     encode=lambda text, specials=True: tok.encode(
                         text, add_special_tokens=specials).ids,
                     decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                     vocab_size=cfg.vocab_size, context=cfg.max_len, bos_id=None, eos_ids=eos,
                     description=hf)
        first = src.encode("", True)  # the post-processor's BOS, if it adds one
        src.bos_id = first[0] if first else None
        where = f"--hf {hf}: {os.path.join(hf, 'tokenizer.json')}"
    else:
        if not os.path.isdir(workdir):
            raise ValueError(f"--workdir: {workdir} is not a directory; point it at the "
                             f"directory a `python -m tfjax.train --workdir ...` run wrote")
        model, cfg, tok, step = load_run(workdir, step)
        n_tok = tok.vocab_size
        src = run_source(model, cfg, tok, description=f"step {step} of {workdir}", step=step)
        where = f"--workdir {workdir}: data.tokenizer {cfg.data.tokenizer!r}"
    if n_tok > src.vocab_size:
        raise ValueError(f"{where} has {n_tok} ids but the model's vocab_size is "
                         f"{src.vocab_size}: the tokenizer is not this model's; use the "
                         f"tokenizer the checkpoint was trained with")
    return src


def run_source(model, cfg, tok, *, description: str, step: int | None = None) -> Source:
    """The Source of a tfjax training run's `model` (its RunConfig `cfg`, tokenizer
    `tok`): text as `[bos] + encode(text)`, as the run's documents begin; the context
    `train.seq_len`; the run's mesh rules."""
    return Source(model=model,
                  encode=lambda text, specials=True: ([tok.bos_id] if specials else [])
                  + [int(i) for i in tok.encode(text)],
                  decode=lambda ids: tok.decode(ids), vocab_size=cfg.model.vocab_size,
                  context=cfg.train.seq_len, bos_id=tok.bos_id, eos_ids=(tok.eos_id,),
                  rules=cfg.mesh.rules, description=description, step=step)


def check_context(src: Source, context: int, flag: str = "--context") -> int:
    """`context` (tokens per window), checked against the model: >= 1, and within a
    learned position table."""
    if context < 1:
        raise ValueError(f"{flag} must be >= 1, got {context}")
    cfg = src.model.config
    if getattr(cfg, "position", None) == "learned" and context > cfg.max_len:
        raise ValueError(f"{flag} {context} exceeds the model's learned position table "
                         f"(model.max_len={cfg.max_len}); use at most {cfg.max_len}")
    return context


def parse_mesh(text: str | None, rules=DEFAULT_RULES) -> MeshConfig:
    """`--mesh data=2,tensor=2` -> MeshConfig (axes not named are 1, except `data`,
    which fills the devices left over unless given); None: data-parallel over all."""
    if not text:
        return MeshConfig(rules=rules)
    sizes = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not eq:
            raise ValueError(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of "
                             f"{', '.join(MESH_AXES)} (e.g. --mesh data=2,tensor=2)")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh: {part!r}: the size must be an integer (-1: the devices "
                             f"left over)") from None
    return MeshConfig(**sizes, rules=rules)


def eval_mesh(text: str | None, rules=DEFAULT_RULES) -> tuple[jax.sharding.Mesh, MeshConfig]:
    """The mesh of `--mesh` (`parse_mesh`): with an axis of -1 (`data`, unless given) it
    takes every device, as the trainer's; sizes that all are given and multiply to
    fewer than the devices take the first that many (`--mesh data=2` on 8 devices)."""
    cfg = parse_mesh(text, rules)
    devices = jax.devices()
    if -1 not in cfg.shape and math.prod(cfg.shape) < len(devices):
        devices = devices[:math.prod(cfg.shape)]
    return make_mesh(cfg, devices), cfg


def add_eval_flags(parser: argparse.ArgumentParser, per_batch: str) -> None:
    """`--step`, `--batch_size` (`per_batch`: what a batch holds), `--mesh`,
    `--cpu_devices` and `--progress`: the flags of every evaluation command."""
    parser.add_argument("--step", type=int, default=None,
                        help="checkpoint step (default: latest)")
    parser.add_argument("--batch_size", type=int, default=8,
                        help=f"{per_batch} per batch (all devices)")
    parser.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. data=4,fsdp=2 or "
                        "sequence=4 (default: data-parallel over all devices)")
    parser.add_argument("--cpu_devices", type=int, default=0,
                        help="simulate this many CPU devices (XLA host platform)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="the progress bar")


def simulate_cpu_devices(n: int) -> None:
    """`--cpu_devices n` (0: as they are): XLA's host platform with n devices, read by
    jax when its backend starts, at the first device query."""
    if n:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}")
