"""The trainer's config sections (train, data, mesh, checkpoint) and `RunConfig`,
the whole run: frozen dataclasses and their range and combination checks. Each
error names the field (`train.batch_size`) and what would be right; checks that
need the devices or the data run in `tfjax.train.trainer.check_run`."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, one_of, positive
from tfjax.config.model import ModelConfig, validate_model

__all__ = ["CheckpointConfig", "DataConfig", "DEFAULT_RULES", "MESH_AXES", "MeshConfig",
           "RunConfig", "TrainConfig"]

MESH_AXES = ("data", "fsdp", "sequence", "tensor", "expert")
SCHEDULES = ("cosine", "constant")
DATA_SOURCES = ("stdlib", "text", "jsonl")

# Logical axis name -> mesh axes (first entry the logical name, then zero or more
# mesh axes; none = replicated). Parameters and activations share the table: a mesh
# axis already used by an earlier dimension of the same array is skipped, so
# activation "embed" is replicated once "batch" took "fsdp", while parameter
# "embed" is FSDP-sharded. Every logical name a model uses must appear here.
DEFAULT_RULES: tuple[tuple[str, ...], ...] = (
    ("batch", "data", "fsdp", "expert"),
    ("length", "sequence"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim",),
    ("latent",),  # latent attention's low-rank dims (q and kv latents)
    ("expert", "expert"),
    ("norm",),
    ("layers",),
    ("max_len",),
    ("relpos_buckets",),
    ("classes",),
    ("type_vocab",),
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop settings of `tfjax.train` (sizes are global, over all devices).

    lr schedule: linear warmup over `warmup_steps` to `lr`, then cosine decay to
      `lr * lr_min_ratio` at `steps` (or constant).
    microbatches: gradient accumulation; each step sums the gradients of
      `microbatches` slices of the global batch (same result as one big batch).
    Activation checkpointing is `model.remat` (per scanned layer, in the model).
    z_loss: weight of log(Z)^2 (PaLM); 0 = off.
    peak_flops: per-device peak FLOP/s for MFU; 0 = from a table of chips, or a
      matmul measured at start on CPU.
    objective: what the model learns (`tfjax.train.objectives`, which checks it
      against model.arch): decoder "causal_lm" | "prefix_lm"; encoder "mlm" |
      "classification"; encoder_decoder "span_corruption" | "seq2seq".
    mlm_rate, whole_word_mask: MLM's share of real tokens selected (80/10/10), and
      whether whole words are selected. noise_density, mean_span_length: span
      corruption's (T5: 0.15, 3). target_len: the decoder length of the
      encoder-decoder objectives; 0 = automatic.
    """

    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 256
    microbatches: int = 1
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 100
    lr_min_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    z_loss: float = 0.0
    log_every: int = 10
    eval_every: int = 0  # 0 -> evaluate at the end only
    eval_batches: int = 8  # 0 -> the whole validation split
    eval_at_end: bool = True
    sample_tokens: int = 120  # greedy sample printed at the end; 0 = none
    sample_prompt: str = "import "
    peak_flops: float = 0.0
    progress: bool = True
    # JAX's persistent compilation cache (tfjax.train.compile_cache): "auto" -> JAX's
    # configured directory, else WORKDIR/compilation_cache; "workdir"; a path; "" -> off
    compilation_cache: str = "auto"
    objective: str = "causal_lm"
    mlm_rate: float = 0.15
    whole_word_mask: bool = False
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    target_len: int = 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    source: stdlib (the Python standard library's own .py files; validation iff
      int(sha1(relative path).hexdigest(), 16) % 50 == 0) | text (files or globs
      in `paths`, one document per file) | jsonl (one document per line, field
      `jsonl_field`). For text/jsonl, `val_paths` names the validation files; if
      empty, the same sha1 rule splits files (text) or lines (jsonl).
    tokenizer: "byte" (256 bytes + specials) or a local file: a `tokenizers` JSON
      or a sentencepiece `.model`.
    """

    source: str = "stdlib"
    paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()
    jsonl_field: str = "text"
    tokenizer: str = "byte"
    shuffle: bool = True


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (-1 fills the rest; at most one) and the logical-axis rules."""

    data: int = -1
    fsdp: int = 1
    sequence: int = 1
    tensor: int = 1
    expert: int = 1
    rules: tuple[tuple[str, ...], ...] = DEFAULT_RULES

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """orbax checkpoints under WORKDIR/checkpoints: every `every_steps` (0 = only at
    the end) and on SIGTERM, keep the last `keep`; `resume` continues from the latest.
    `fallback`: when the newest checkpoint cannot be read (truncated or missing files,
    garbled metadata), resume from the newest older one that can, with a warning, and
    move the damaged step whole to WORKDIR/damaged_checkpoints/; False stops the run
    with an error naming the damaged step instead (`tfjax.train.checkpoint`)."""

    enabled: bool = True  # False: no checkpoints at all (quick experiments)
    every_steps: int = 500
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    fallback: bool = True


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run: the model plus the sections the trainer owns (train, data, mesh, ...)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    seed: int = 0
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def validate(self) -> "RunConfig":
        validate_model(self.model, "model")
        _validate_train(self.train, "train")
        _validate_data(self.data, "data")
        _validate_mesh(self.mesh, "mesh")
        _validate_checkpoint(self.checkpoint, "checkpoint")
        return self


def _validate_train(c: TrainConfig, p: str) -> None:
    for name in ("steps", "batch_size", "seq_len", "microbatches", "lr", "log_every", "eps"):
        positive(f"{p}.{name}", getattr(c, name))
    for name in ("warmup_steps", "weight_decay", "grad_clip", "z_loss", "eval_every",
                 "eval_batches", "sample_tokens", "peak_flops", "target_len"):
        non_negative(f"{p}.{name}", getattr(c, name))
    for name in ("mlm_rate", "noise_density"):
        if not 0.0 < getattr(c, name) < 1.0:
            fail(f"{p}.{name}", f"must be in (0, 1), got {getattr(c, name)!r}")
    if c.mean_span_length < 1.0:
        fail(f"{p}.mean_span_length", f"must be >= 1, got {c.mean_span_length!r}")
    one_of(f"{p}.schedule", c.schedule, SCHEDULES)
    if not 0.0 <= c.lr_min_ratio <= 1.0:
        fail(f"{p}.lr_min_ratio", f"must be in [0, 1], got {c.lr_min_ratio!r}")
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(c, name) < 1.0:
            fail(f"{p}.{name}", f"must be in [0, 1), got {getattr(c, name)!r}")
    if c.batch_size % c.microbatches:
        fail(f"{p}.batch_size", f"{c.batch_size} is not divisible by train.microbatches="
              f"{c.microbatches}; use a multiple of it")


def _validate_data(c: DataConfig, p: str) -> None:
    one_of(f"{p}.source", c.source, DATA_SOURCES)
    if c.source == "stdlib" and (c.paths or c.val_paths):
        fail(f"{p}.paths", "the stdlib corpus takes no paths; set data.source='text' or "
              "'jsonl' to read your own files")
    if c.source in ("text", "jsonl") and not c.paths:
        fail(f"{p}.paths", f"data.source={c.source!r} needs files or globs, e.g. "
              "--config.data.paths=\"('corpus/*.txt',)\"")
    if not c.tokenizer:
        fail(f"{p}.tokenizer", "use 'byte' or a path to a tokenizers .json / sentencepiece .model")
    if c.source == "jsonl" and not c.jsonl_field:
        fail(f"{p}.jsonl_field", "name the JSON field that holds the text, e.g. 'text'")


def _validate_mesh(c: MeshConfig, p: str) -> None:
    fill = [a for a in MESH_AXES if getattr(c, a) == -1]
    for a in MESH_AXES:
        v = getattr(c, a)
        if v != -1 and v < 1:
            fail(f"{p}.{a}", f"must be >= 1, or -1 to take the remaining devices, got {v}")
    if len(fill) > 1:
        fail(f"{p}.{fill[1]}", f"only one mesh axis may be -1 (fill the rest); "
              f"{', '.join(fill)} are; give all but one a size")
    seen: set[str] = set()
    for i, rule in enumerate(c.rules):
        f = f"{p}.rules[{i}]"
        if not rule or not isinstance(rule[0], str) or not rule[0]:
            fail(f, f"each rule is (logical_name, *mesh_axes), got {rule!r}")
        if rule[0] in seen:
            fail(f, f"logical axis {rule[0]!r} appears twice; keep one rule per name")
        seen.add(rule[0])
        for axis in rule[1:]:
            if axis not in MESH_AXES:
                fail(f, f"unknown mesh axis {axis!r} for {rule[0]!r}; mesh axes: "
                      f"{', '.join(MESH_AXES)}")
        if len(set(rule[1:])) != len(rule[1:]):
            fail(f, f"mesh axis repeated in {rule!r}")


def _validate_checkpoint(c: CheckpointConfig, p: str) -> None:
    non_negative(f"{p}.every_steps", c.every_steps)
    positive(f"{p}.keep", c.keep)
