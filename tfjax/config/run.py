"""The trainer's config sections (train, data, mesh, checkpoint) and `RunConfig`,
the whole run: frozen dataclasses and their range and combination checks. Each
error names the field (`train.batch_size`) and what would be right; checks that
need the devices or the data run in `tfjax.train.trainer.check_run`."""

from __future__ import annotations

import dataclasses

from tfjax.config.checks import fail, non_negative, one_of, positive
from tfjax.config.grpo import GRPOConfig, validate_grpo
from tfjax.config.model import ModelConfig, validate_model
from tfjax.config.posttrain import DistillConfig, PreferenceConfig, validate_posttrain

__all__ = ["CheckpointConfig", "DataConfig", "DCN_AXES", "DEFAULT_RULES", "DECAY_SHAPES", "LoraConfig",
           "MESH_AXES", "MeshConfig", "ParamGroup", "RunConfig", "SCHEDULES", "TrainConfig",
           "parse_param_groups", "parse_profile_steps"]

MESH_AXES = ("data", "fsdp", "sequence", "tensor", "expert")
DCN_AXES = ("data", "fsdp")  # the mesh axes that may also span slices (`MeshConfig.dcn_*`)
SCHEDULES = ("cosine", "constant", "linear", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # the decay of the wsd schedule
DATA_SOURCES = ("stdlib", "text", "jsonl", "cache", "synthetic")
DATA_FORMATS = ("document", "instruction")
WANDB_MODES = ("online", "offline", "disabled")

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

    optimizer (`tfjax.train.optim.OPTIMIZERS`, one record each): "adamw" (default;
      b1, b2, eps) | "muon" (orthogonalised momentum for the matrices, AdamW with
      b1, b2, eps for embeddings, the output head, norms, biases and other
      non-matrices; muon_beta, muon_ns_steps, muon_nesterov, muon_rms) | "adafactor"
      (factored second moments; adafactor_decay, adafactor_min_dim, adafactor_clip)
      | "lion" (sign of the b1-interpolated momentum, momentum decay b2) | "sgd"
      (momentum, nesterov; momentum=0 is plain SGD).
    weight_decay: decoupled, as AdamW's for every optimizer: each step subtracts
      lr(step) * weight_decay * param, on matrices only (parameters with >= 2 logical
      axes other than "layers"), never on norm scales and biases.
    grad_clip: global-norm clipping before the optimizer; 0 = off.
    muon_rms: Muon's update scale: sqrt(max(fan_in, fan_out)) * muon_rms, so its
      update RMS matches AdamW's and `lr` is shared by both halves (0.2, Moonlight);
      0 = Keller Jordan's sqrt(max(1, fan_out / fan_in)) (then use a larger `lr`).
    lr schedule: linear warmup over `warmup_steps` to `lr`, then "cosine" decay to
      `lr * lr_min_ratio` at `steps`, "linear" decay to it, "constant", or "wsd"
      (warmup-stable-decay): constant `lr` until the last `decay_fraction` of `steps`,
      then down to `lr * lr_min_ratio` at `steps` in `decay_shape` ("linear",
      "cosine" or "1-sqrt": lr * (1 - sqrt(fraction of the decay done))).
    param_groups: per-parameter learning-rate multipliers and weight decay, e.g.
      "embed:lr=0.5,wd=0;@norm:lr=2" (`tfjax.train.optim.param_labels`): groups
      separated by ";", each "PATTERN:key=value,...". PATTERN "@AXIS" matches the
      parameters with logical axis AXIS ("@norm", "@vocab", "@expert"); any other
      PATTERN matches the parameters whose path (keys joined by "/", e.g.
      "embed/tokens/embedding", "layers/cycles/layers/0/attn/q/kernel") contains it.
      A parameter takes the first group that matches it. lr=X multiplies the
      schedule; wd=X is the group's absolute weight decay, applied to every
      parameter of the group (matrix or not); without wd the group keeps
      `weight_decay` on its matrices. A group that matches no parameter is an error.
    microbatches: gradient accumulation; each step sums the gradients of
      `microbatches` slices of the global batch (same result as one big batch).
    Activation checkpointing is `model.remat` (per scanned layer, in the model).
    z_loss: weight of log(Z)^2 (PaLM); 0 = off.
    loss_chunk: the decoder objectives' next-token loss computes the logits of at
      most this many positions of a row at once on each device (a sequence-sharded
      row: this many on each of its shards), recomputing them in the backward
      (`tfjax.train.losses.chunked_cross_entropy_sums`): no `[B, T, V]` float32
      logits in memory; 0 (or >= seq_len) = all at once. The same sums (bitwise in
      float32) and gradients within rounding.
    peak_flops: per-device peak FLOP/s for MFU; 0 = from a table of chips, or a
      matmul measured at start on CPU.
    objective: what the model learns (`tfjax.train.objectives`, which checks it
      against model.arch): decoder "causal_lm" | "prefix_lm"; encoder "mlm" |
      "classification"; encoder_decoder "span_corruption" | "seq2seq".
    mlm_rate, whole_word_mask: MLM's share of real tokens selected (80/10/10), and
      whether whole words are selected. noise_density, mean_span_length: span
      corruption's (T5: 0.15, 3). target_len: the decoder length of the
      encoder-decoder objectives; 0 = automatic.
    Post-training (`tfjax.config.posttrain`, docs/training.md "Post-training"):
      decoder "dpo" | "ipo" | "orpo" | "simpo" (`preference`: beta, label_smoothing,
      simpo_gamma) on jsonl pairs; "distill" from `teacher` (a Hugging Face directory
      or a tfjax workdir with the student's vocabulary; `distill`: beta, temperature).
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
    optimizer: str = "adamw"
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    muon_beta: float = 0.95
    muon_ns_steps: int = 5
    muon_nesterov: bool = True
    muon_rms: float = 0.2
    adafactor_decay: float = 0.8  # second-moment decay 1 - step^-adafactor_decay
    adafactor_min_dim: int = 128  # factor only dims at least this large
    adafactor_clip: float = 1.0  # update clipping by block RMS; 0 = off
    decay_fraction: float = 0.2  # wsd
    decay_shape: str = "linear"  # wsd
    param_groups: str = ""
    z_loss: float = 0.0
    loss_chunk: int = 512  # chosen from experiments/results/vs_maxtext.md
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
    # Weights & Biases (tfjax.train.metrics.MetricWriter): the project to log to ("" =
    # off); wandb_mode "online" | "offline" (no network: WORKDIR/wandb, `wandb sync`
    # later) | "disabled" | "" (wandb's own default: WANDB_MODE, else online)
    wandb: str = ""
    wandb_mode: str = ""
    # "A,B": a jax.profiler trace of steps A..B (1-based, inclusive) in WORKDIR/profile
    profile_steps: str = ""
    # lm-eval-harness tasks scored at every evaluation ("a,b"; tfjax.eval.harness, the
    # `eval` extra), from lm-eval's own and the task YAMLs in eval_tasks_path;
    # eval_tasks_limit documents per task (0 = all)
    eval_tasks: str = ""
    eval_tasks_path: str = ""
    eval_tasks_limit: int = 0
    objective: str = "causal_lm"
    mlm_rate: float = 0.15
    whole_word_mask: bool = False
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    target_len: int = 0
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    teacher: str = ""
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # objective "grpo"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    source: stdlib (the Python standard library's own .py files; validation iff
      int(sha1(relative path).hexdigest(), 16) % 50 == 0) | text (files or globs
      in `paths`, one document per file) | jsonl (one document per line, field
      `jsonl_field`) | cache (token caches of `python -m tfjax.data.prepare`). For
      text/jsonl, `val_paths` names the validation files; if empty, the same sha1
      rule splits files (text) or lines (jsonl). The objectives that read examples
      (classification, seq2seq, preference) take jsonl, parquet and `datasets`
      inputs alike with source jsonl (`tfjax.data.objectives.read_examples`).
      synthetic: the objective's shipped examples (speech_to_text: spoken digits,
      `tfjax.data.speech`); no paths.
    tokenizer: "byte" (256 bytes + specials), a local file (a `tokenizers` JSON or
      a sentencepiece `.model`) or directory (its tokenizer.json or tokenizer.model,
      specials from the files beside it), or "init_from": the tokenizer of the
      checkpoint `init_from` names (its directory, or the tfjax run's data.tokenizer).
    format: "document" (every token is a target) | "instruction" (jsonl only: each
      line a "prompt" and a "completion" string, laid out as one packed document,
      the loss on the completion tokens only; `tfjax.data.pipeline`).
    cache (`tfjax.data.mixture`): `paths` are prepared cache directories, mixed by
      `weights` (one per path; () = in proportion to each cache's tokens) and from
      each `stages` entry's start step on by its weights; `block_rows` rows per
      block of fixed per-source counts.
    """

    source: str = "stdlib"
    paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()
    jsonl_field: str = "text"
    tokenizer: str = "byte"
    shuffle: bool = True
    format: str = "document"
    weights: tuple[float, ...] = ()
    stages: tuple[tuple[int, tuple[float, ...]], ...] = ()
    block_rows: int = 2048


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (-1 fills the rest; at most one) and the logical-axis rules.

    data ... expert: sizes within one slice (ICI). dcn_data, dcn_fsdp: how many slices
    (TPU slices joined by the data-center network; on CPU, processes) the same named
    axis spans, so mesh axis `data` has dcn_data * data devices; the dcn_* sizes
    multiply to the number of slices (`tfjax.parallel.mesh.make_mesh`).
    """

    data: int = -1
    fsdp: int = 1
    sequence: int = 1
    tensor: int = 1
    expert: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    rules: tuple[tuple[str, ...], ...] = DEFAULT_RULES

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes within a slice, in `MESH_AXES` order."""
        return tuple(getattr(self, a) for a in MESH_AXES)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        """How many slices each mesh axis spans, in `MESH_AXES` order (1 where no DCN)."""
        return tuple(getattr(self, f"dcn_{a}") if a in DCN_AXES else 1 for a in MESH_AXES)


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
class LoraConfig:
    """LoRA (Hu et al. 2021) fine-tuning (`tfjax.train.lora`): the base weights frozen,
    each targeted matrix W trained as W + (alpha / rank) * A @ B.

    rank: r, the adapters' inner dimension; 0 = off (train every parameter).
    alpha: the scale is alpha / rank; 0 = alpha equals rank (scale 1).
    targets: comma-separated names of the matrices to adapt: q, k, v, o (attention),
      gate, up, down (FFN), or the groups attn, mlp, all (`tfjax.train.lora.TARGETS`
      maps each to tfjax's parameter paths). A name that matches no parameter of the
      model is an error.
    """

    rank: int = 0
    alpha: float = 0.0
    targets: str = "q,v"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run: the model plus the sections the trainer owns (train, data, mesh, ...).

    init_from: fine-tuning: a Hugging Face checkpoint directory (config.json +
      safetensors) or a tfjax training workdir to take the model and its weights from
      (`tfjax.train.init_from`, which says how the model section must agree); "" =
      train from scratch.
    context_extension: with `init_from`, the config's `model.max_len` and `model.rope.*`
      (scaling, factor, original_max_len, theta, ...) may differ from the
      checkpoint's and win: continuing a RoPE model at a longer context with a new
      RoPE scaling (`tfjax.train.init_from.CONTEXT_FIELDS`, docs/long_context.md).
    lora: LoRA fine-tuning (`LoraConfig`, `tfjax.train.lora`); lora.rank=0 = off.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    seed: int = 0
    init_from: str = ""
    context_extension: bool = False
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def validate(self) -> "RunConfig":
        validate_model(self.model, "model")
        _validate_train(self.train, "train")
        _validate_data(self.data, "data")
        _validate_mesh(self.mesh, "mesh")
        _validate_checkpoint(self.checkpoint, "checkpoint")
        _validate_lora(self.lora, "lora")
        seq, heads = self.mesh.sequence, self.model.num_heads
        a = self.model.attention
        if a.context_parallel == "ulysses" and seq > 1 and heads % seq:
            fail("model.attention.context_parallel", f"'ulysses' gives each of the "
                 f"mesh.sequence={seq} devices num_heads / {seq} query heads, but num_heads="
                 f"{heads}; set mesh.sequence to a divisor of {heads}, or use "
                 f"context_parallel='ring' or 'usp'")
        u = a.ulysses_size
        if a.context_parallel == "usp" and seq > 1 and (seq % u or heads % u):
            fail("model.attention.ulysses_size", f"{u} must divide mesh.sequence={seq} and "
                 f"num_heads={heads} (Ulysses groups of {u} devices, each holding num_heads / "
                 f"{u} heads); set it to a common divisor")
        if self.data.tokenizer == "init_from" and not self.init_from:
            fail("data.tokenizer", "'init_from' takes the tokenizer of the checkpoint that "
                 "init_from names, but init_from is empty; set --config.init_from=DIR or name "
                 "a tokenizer ('byte' or a file)")
        if self.context_extension and not self.init_from:
            fail("context_extension", "continues the checkpoint that init_from names at a "
                 "longer context, but init_from is empty; set --config.init_from=DIR or drop "
                 "--config.context_extension")
        validate_posttrain(self.train.objective, self.train.preference, self.train.distill,
                           self.train.teacher, self.init_from)
        if self.data.format == "instruction" and self.train.objective != "causal_lm":
            fail("data.format", f"'instruction' scores the completions of a causal LM, but "
                 f"train.objective={self.train.objective!r}; set --config.train.objective="
                 f"causal_lm or data.format='document'")
        return self


def _validate_train(c: TrainConfig, p: str) -> None:
    for name in ("steps", "batch_size", "seq_len", "microbatches", "lr", "log_every", "eps"):
        positive(f"{p}.{name}", getattr(c, name))
    for name in ("warmup_steps", "weight_decay", "grad_clip", "z_loss", "loss_chunk", "eval_every",
                 "eval_batches", "sample_tokens", "peak_flops", "target_len"):
        non_negative(f"{p}.{name}", getattr(c, name))
    for name in ("mlm_rate", "noise_density"):
        if not 0.0 < getattr(c, name) < 1.0:
            fail(f"{p}.{name}", f"must be in (0, 1), got {getattr(c, name)!r}")
    if c.mean_span_length < 1.0:
        fail(f"{p}.mean_span_length", f"must be >= 1, got {c.mean_span_length!r}")
    one_of(f"{p}.schedule", c.schedule, SCHEDULES)
    one_of(f"{p}.decay_shape", c.decay_shape, DECAY_SHAPES)
    if not 0.0 <= c.decay_fraction <= 1.0:
        fail(f"{p}.decay_fraction", f"must be in [0, 1], got {c.decay_fraction!r}")
    for name in ("momentum", "muon_beta"):
        if not 0.0 <= getattr(c, name) < 1.0:
            fail(f"{p}.{name}", f"must be in [0, 1), got {getattr(c, name)!r}")
    positive(f"{p}.muon_ns_steps", c.muon_ns_steps)
    positive(f"{p}.adafactor_decay", c.adafactor_decay)
    positive(f"{p}.adafactor_min_dim", c.adafactor_min_dim)
    for name in ("muon_rms", "adafactor_clip"):
        non_negative(f"{p}.{name}", getattr(c, name))
    if c.optimizer == "sgd" and c.nesterov and not c.momentum:
        fail(f"{p}.nesterov", "Nesterov momentum needs train.momentum > 0")
    parse_param_groups(c.param_groups, f"{p}.param_groups")
    if c.wandb_mode:
        one_of(f"{p}.wandb_mode", c.wandb_mode, WANDB_MODES)
    parse_profile_steps(c.profile_steps, c.steps, f"{p}.profile_steps")
    non_negative(f"{p}.eval_tasks_limit", c.eval_tasks_limit)
    if c.eval_tasks and c.objective != "causal_lm":
        fail(f"{p}.eval_tasks", f"lm-eval tasks score a causal LM; train.objective is "
             f"{c.objective!r}")
    if not 0.0 <= c.lr_min_ratio <= 1.0:
        fail(f"{p}.lr_min_ratio", f"must be in [0, 1], got {c.lr_min_ratio!r}")
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(c, name) < 1.0:
            fail(f"{p}.{name}", f"must be in [0, 1), got {getattr(c, name)!r}")
    if c.batch_size % c.microbatches:
        fail(f"{p}.batch_size", f"{c.batch_size} is not divisible by train.microbatches="
              f"{c.microbatches}; use a multiple of it")
    if c.objective == "grpo":
        validate_grpo(c.grpo, f"{p}.grpo")
        if c.batch_size % c.grpo.num_generations:
            fail(f"{p}.batch_size", f"{c.batch_size} completions do not divide into groups of "
                 f"train.grpo.num_generations={c.grpo.num_generations}; use a multiple of it")


def parse_profile_steps(text: str, steps: int,
                        field: str = "train.profile_steps") -> tuple[int, int] | None:
    """"A,B" -> (A, B), the first and last step (1-based, inclusive) to trace; "" ->
    None. Anything else, or a range outside 1..steps, fails naming `field`."""
    if not text.strip():
        return None
    parts = text.split(",")
    try:
        first, last = (int(x) for x in parts)
    except ValueError:
        fail(field, f"got {text!r}; write 'A,B' (first and last step to trace, e.g. '5,7')")
    if not 1 <= first <= last <= steps:
        fail(field, f"got {text!r}; need 1 <= A <= B <= train.steps={steps}")
    return first, last


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One group of `TrainConfig.param_groups`: its pattern, lr multiplier and weight
    decay (None: not set)."""

    pattern: str
    lr: float | None = None
    wd: float | None = None


def parse_param_groups(text: str, field: str = "train.param_groups") -> tuple[ParamGroup, ...]:
    """"embed:lr=0.5,wd=0;@norm:wd=0" -> ParamGroups, in order; malformed text fails
    naming `field`. Which parameters a pattern matches is `tfjax.train.optim`'s."""
    form = ("write groups as 'PATTERN:lr=X,wd=Y;PATTERN:...' (PATTERN a piece of a "
            "parameter path, or @AXIS for a logical axis name)")
    groups: list[ParamGroup] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        pattern, sep, opts = (x.strip() for x in part.partition(":"))
        if not sep or not pattern or pattern == "@":
            fail(field, f"group {part!r} has no 'PATTERN:'; {form}")
        if any(g.pattern == pattern for g in groups):
            fail(field, f"pattern {pattern!r} appears twice; keep one group per pattern")
        values: dict[str, float] = {}
        for item in (x.strip() for x in opts.split(",")):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in ("lr", "wd"):
                fail(field, f"group {part!r}: {item!r} is not lr=X or wd=X; {form}")
            if key in values:
                fail(field, f"group {part!r} sets {key} twice")
            try:
                values[key] = float(value)
            except ValueError:
                fail(field, f"group {part!r}: {key}={value!r} is not a number")
            if values[key] < 0:
                fail(field, f"group {part!r}: {key} must be >= 0, got {value}")
        groups.append(ParamGroup(pattern, values.get("lr"), values.get("wd")))
    return tuple(groups)


def _validate_data(c: DataConfig, p: str) -> None:
    one_of(f"{p}.source", c.source, DATA_SOURCES)
    if c.source == "stdlib" and (c.paths or c.val_paths):
        fail(f"{p}.paths", "the stdlib corpus takes no paths; set data.source='text' or "
              "'jsonl' to read your own files")
    if c.source == "synthetic" and (c.paths or c.val_paths):
        fail(f"{p}.paths", "data.source='synthetic' (the objective's shipped examples) takes no "
             "paths; set data.source='jsonl' to read your own files")
    if c.source in ("text", "jsonl") and not c.paths:
        fail(f"{p}.paths", f"data.source={c.source!r} needs files or globs, e.g. "
              "--config.data.paths=\"('corpus/*.txt',)\"")
    if not c.tokenizer:
        fail(f"{p}.tokenizer", "use 'byte' or a path to a tokenizers .json / sentencepiece .model")
    if c.source == "jsonl" and not c.jsonl_field:
        fail(f"{p}.jsonl_field", "name the JSON field that holds the text, e.g. 'text'")
    one_of(f"{p}.format", c.format, DATA_FORMATS)
    if c.format == "instruction" and c.source != "jsonl":
        fail(f"{p}.format", f"'instruction' reads jsonl lines with \"prompt\" and "
             f"\"completion\", but data.source={c.source!r}; set --config.data.source=jsonl")
    _validate_mixture(c, p)


def _validate_weights(field: str, weights: tuple[float, ...], n: int) -> None:
    if len(weights) != n:
        fail(field, f"{len(weights)} weight(s) for {n} cache(s) in data.paths; give one "
             f"weight per path")
    if any(not w >= 0 or w == float("inf") for w in weights):
        fail(field, f"{weights} has a negative or non-finite weight; weights must be >= 0")
    if sum(weights) <= 0:
        fail(field, f"{weights} sums to zero; give some cache a weight > 0")


def _validate_mixture(c: DataConfig, p: str) -> None:
    if c.source != "cache":
        for name in ("weights", "stages"):
            if getattr(c, name):
                fail(f"{p}.{name}", f"mixes token caches, but data.source={c.source!r}; set "
                     f"--config.data.source=cache (paths: prepared cache directories)")
        return
    if not c.paths:
        fail(f"{p}.paths", "data.source='cache' needs prepared cache directories (python -m "
             "tfjax.data.prepare ... --output DIR), e.g. --config.data.paths=\"('DIR',)\"")
    if c.val_paths:
        fail(f"{p}.val_paths", "a cache holds its own validation split; leave data.val_paths "
             "empty with data.source='cache'")
    positive(f"{p}.block_rows", c.block_rows)
    if c.weights:
        _validate_weights(f"{p}.weights", c.weights, len(c.paths))
    last = 0
    for i, (step, weights) in enumerate(c.stages):
        if step <= last:
            fail(f"{p}.stages[{i}]", f"starts at step {step}, not after "
                 f"{'step 0' if i == 0 else f'the previous stage (step {last})'}; list stages "
                 f"by increasing start step > 0 (data.weights hold from step 0)")
        _validate_weights(f"{p}.stages[{i}]", weights, len(c.paths))
        last = step


def _validate_mesh(c: MeshConfig, p: str) -> None:
    fill = [a for a in MESH_AXES if getattr(c, a) == -1]
    for a in MESH_AXES:
        v = getattr(c, a)
        if v != -1 and v < 1:
            fail(f"{p}.{a}", f"must be >= 1, or -1 to take the remaining devices, got {v}")
    for a in DCN_AXES:
        if getattr(c, f"dcn_{a}") < 1:
            fail(f"{p}.dcn_{a}", f"must be >= 1 (the slices mesh axis {a!r} spans; 1 = "
                 f"within one slice), got {getattr(c, f'dcn_{a}')}")
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


def _validate_lora(c: LoraConfig, p: str) -> None:
    if c.rank < 0 or (c.rank == 0 and c.alpha):
        fail(f"{p}.rank", f"got {c.rank}{f' with lora.alpha={c.alpha}' if c.alpha else ''}; "
             f"LoRA needs a rank > 0 (e.g. --config.lora.rank=8), or leave lora.rank=0 "
             f"(and lora.alpha=0) to train every parameter")
    non_negative(f"{p}.alpha", c.alpha)
    if c.rank and not [t for t in c.targets.split(",") if t.strip()]:
        fail(f"{p}.targets", "names no matrix; give e.g. --config.lora.targets=q,v (or attn, "
             "mlp, all)")


def _validate_checkpoint(c: CheckpointConfig, p: str) -> None:
    non_negative(f"{p}.every_steps", c.every_steps)
    positive(f"{p}.keep", c.keep)
