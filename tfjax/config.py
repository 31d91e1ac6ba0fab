"""The config boundary: an `ml_collections.ConfigDict` becomes frozen dataclasses.

Presets in `configs/` are code (`get_config(arg=None) -> ConfigDict`) so they can
be overridden from the command line (`--config.model.num_layers=4`). The trainer,
the model builder and everything below take the frozen dataclasses made here,
never the ConfigDict, and every module takes explicit keyword arguments.

Validation happens here, before anything is traced: an unknown key, a wrong type
or an invalid value raises `ValueError` naming the field (`model.num_kv_heads`)
and what would be right.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Mapping

import ml_collections

__all__ = [
    "RopeConfig",
    "ModelConfig",
    "TrainConfig",
    "DataConfig",
    "MeshConfig",
    "CheckpointConfig",
    "RunConfig",
    "model_config",
    "run_config",
    "default_config",
    "apply_variant",
    "from_dict",
    "to_config_dict",
]

# Names not owned by a registry (registries own norms, activations, positions,
# rope scalings, blocks, layer kinds, architectures and attention implementations).
NORM_PLACEMENTS = ("pre", "post", "sandwich")
ROPE_LAYOUTS = ("half", "interleaved")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding (Su et al. 2021) and its context-extension scalings.

    layout: "half" rotates (x[:h/2], x[h/2:]) pairs (GPT-NeoX, Llama); "interleaved"
      rotates (x[2i], x[2i+1]) pairs (GPT-J, the paper).
    fraction: share of the head dim that is rotated (partial rotary: NeoX 0.25).
    scaling: none | linear (position interpolation, Chen et al. 2023) | ntk
      (NTK-aware base change) | dynamic_ntk (NTK base grown with the length seen)
      | yarn (Peng et al. 2023, with its attention temperature) | llama3.
    factor: context extension factor s (>= 1).
    original_max_len: pre-training context of the scaled model (dynamic_ntk, yarn, llama3).
    """

    theta: float = 10000.0
    fraction: float = 1.0
    layout: str = "half"
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int = 2048
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # yarn: attention temperature multiplier (0.1 * mscale * ln s + 1)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architecture knob of tfjax. Zero means "derive" or "off" where noted."""

    arch: str = "decoder"  # decoder | encoder | encoder_decoder
    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2  # decoder layers (encoder layers for arch="encoder")
    num_encoder_layers: int = 0  # encoder_decoder only; 0 -> num_layers
    num_heads: int = 4
    num_kv_heads: int = 0  # 0 -> num_heads (MHA); 1 -> MQA; else GQA
    head_dim: int = 0  # 0 -> d_model // num_heads
    d_ff: int = 256
    max_len: int = 2048  # learned / sinusoidal position tables

    # Feed-forward.
    activation: str = "gelu"  # relu | gelu | gelu_tanh | silu | reglu | geglu | geglu_tanh | swiglu
    ffn_bias: bool = True

    # Attention.
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    attn_scale: float = 0.0  # 0 -> 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # 0 -> off; Gemma 2: 50
    attention_impl: str = "auto"
    # Self-attention when the mesh splits the sequence (mesh.sequence > 1): "ring"
    # (ring attention, K/V circulate; O(S/n) memory) | "all_gather" (each device
    # gathers the whole K/V; the simple baseline). Ignored without a sequence axis.
    context_parallel: str = "ring"
    # Zig-zag load balancing of the causal ring (2n chunks, device i holds i and 2n-1-i):
    # "data" (the trainer reorders each batch once on the host; layers skip the
    # re-layout; falls back to "layer", with a note, for models with order-dependent
    # layers: mamba / linear mixers, ALiBi / T5 biases, capacity-factor MoE) | "layer"
    # (natural-order data, every layer re-lays out q, k, v, out) | "none".
    zigzag: str = "data"
    layer_pattern: tuple[str, ...] = ("global",)  # cycled over layers: global | local
    sliding_window: int = 0  # keys before the query a "local" layer sees (plus itself)
    prefix_lm: bool = False  # decoder: bidirectional over a prefix given at call time

    # Beyond dense attention (tfjax.nn.moe, tfjax.nn.ssm, tfjax.nn.linear_attention).
    # layer_pattern also takes "mamba" and "linear" mixers (decoder only); ffn_pattern
    # is cycled over layers independently: dense | moe | none. The scanned unit is
    # lcm(len(layer_pattern), len(ffn_pattern)) layers.
    ffn_pattern: tuple[str, ...] = ("dense",)
    num_experts: int = 0  # experts per "moe" layer
    experts_per_token: int = 2  # top-k
    moe_d_ff: int = 0  # one expert's hidden width; 0 -> d_ff
    shared_experts: int = 0  # always-on experts added to the routed ones (each moe_d_ff wide)
    router_renormalize: bool = True  # top-k gates renormalised to sum 1 (Mixtral) or raw (Jamba)
    capacity_factor: float = 0.0  # 0 -> dropless; else C = ceil(cf * T * k / E) slots per sequence
    moe_impl: str = "ragged"  # dropless dispatch: ragged (grouped matmul) | dense (every expert)
    moe_aux_loss_weight: float = 0.01  # load-balancing loss (Switch), 1.0 when balanced
    moe_z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
    ssm_d_state: int = 16  # Mamba state size N
    ssm_d_conv: int = 4  # depthwise causal conv width
    ssm_expand: int = 2  # inner width = expand * d_model
    ssm_dt_rank: int = 0  # 0 -> ceil(d_model / 16)
    ssm_chunk: int = 0  # 0 -> one associative scan over T; else chunks of this many steps
    ssm_conv_bias: bool = True
    ssm_proj_bias: bool = False  # in/out projection biases
    ssm_inner_norm: bool = False  # RMSNorm on dt, B, C (Jamba)
    linear_feature_map: str = "elu_plus_one"  # linear attention phi: elu_plus_one | relu | softplus
    linear_chunk: int = 64  # causal linear attention chunk

    # Positions.
    position: str = "rope"  # none | sinusoidal | learned | rope | alibi | t5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    t5_num_buckets: int = 32
    t5_max_distance: int = 128

    # Norms and blocks.
    norm: str = "layernorm"  # layernorm | rmsnorm | rmsnorm_plus_one
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    norm_placement: str = "pre"  # pre | post | sandwich
    final_norm: bool = True  # norm after the last block (pre/sandwich models)
    embed_norm: bool = False  # norm after the embeddings (BLOOM, BERT)
    block: str = "sequential"  # sequential | parallel (PaLM, GPT-J, NeoX)
    parallel_shared_norm: bool = True  # parallel block: one norm (GPT-J) or two (NeoX)

    # Embeddings and output.
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply embeddings by sqrt(d_model)
    final_softcap: float = 0.0  # 0 -> off; Gemma 2: 30
    logits_scale: float = 1.0  # multiply the final hidden state before the output projection
    type_vocab_size: int = 0  # encoder: token-type (segment A/B) embeddings; 0 -> none
    num_classes: int = 0  # encoder: classification head on the pooled [CLS]; 0 -> none

    # Numerics and structure.
    dropout_rate: float = 0.0  # residual and embedding dropout
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    init_std: float = 0.02
    scan_layers: bool = True  # scan over repeats of layer_pattern (compile time flat in depth)
    remat: str = "none"  # none | full | dots | dots_no_batch (activation checkpointing)

    # Derived values ----------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def encoder_layers(self) -> int:
        return self.num_encoder_layers or self.num_layers

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_size)

    def ffn_kind(self, i: int) -> str:
        return self.ffn_pattern[i % len(self.ffn_pattern)]

    def layer_kind(self, i: int) -> str:
        return self.layer_pattern[i % len(self.layer_pattern)]

    def validate(self) -> "ModelConfig":
        _validate_model(self, "model")
        return self


# --------------------------------------------------------------------------- #
# Trainer sections (train, data, mesh, checkpoint).
# --------------------------------------------------------------------------- #

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
    the end) and on SIGTERM, keep the last `keep`; `resume` continues from the latest."""

    enabled: bool = True  # False: no checkpoints at all (quick experiments)
    every_steps: int = 500
    keep: int = 3
    async_save: bool = True
    resume: bool = True


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
        _validate_model(self.model, "model")
        _validate_train(self.train, "train")
        _validate_data(self.data, "data")
        _validate_mesh(self.mesh, "mesh")
        _validate_checkpoint(self.checkpoint, "checkpoint")
        return self


# --------------------------------------------------------------------------- #
# Validation.
# --------------------------------------------------------------------------- #


def _fail(field: str, msg: str) -> None:
    raise ValueError(f"{field}: {msg}")


def _one_of(field: str, value: Any, allowed) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        _fail(field, f"got {value!r}; allowed: {', '.join(map(repr, allowed))}")


def _positive(field: str, value: int | float) -> None:
    if value <= 0:
        _fail(field, f"must be > 0, got {value!r}")


def _non_negative(field: str, value: int | float) -> None:
    if value < 0:
        _fail(field, f"must be >= 0 (0 means off), got {value!r}")


def _registries():
    # Imported here: the registries live beside the code they build.
    from tfjax.models import ARCHITECTURES
    from tfjax.models.stack import REMAT_POLICIES
    from tfjax.nn.blocks import BLOCKS, FFN_KINDS, LAYER_KINDS
    from tfjax.nn.linear_attention import FEATURE_MAPS
    from tfjax.nn.ffn import ACTIVATIONS
    from tfjax.nn.norms import NORMS
    from tfjax.nn.positions import POSITIONS, ROPE_SCALINGS
    from tfjax.ops.attention import IMPLEMENTATIONS

    return dict(
        arch=ARCHITECTURES.names(),
        activation=ACTIVATIONS.names(),
        norm=NORMS.names(),
        position=POSITIONS.names(),
        rope_scaling=ROPE_SCALINGS.names(),
        block=BLOCKS.names(),
        layer_kind=LAYER_KINDS.names(),
        ffn_kind=FFN_KINDS.names(),
        feature_map=FEATURE_MAPS.names(),
        attention_impl=("auto",) + IMPLEMENTATIONS.names(),
        remat=REMAT_POLICIES.names(),
    )


def _validate_model(c: ModelConfig, p: str) -> None:
    names = _registries()
    _one_of(f"{p}.arch", c.arch, names["arch"])
    _one_of(f"{p}.activation", c.activation, names["activation"])
    _one_of(f"{p}.norm", c.norm, names["norm"])
    _one_of(f"{p}.norm_placement", c.norm_placement, NORM_PLACEMENTS)
    _one_of(f"{p}.position", c.position, names["position"])
    _one_of(f"{p}.block", c.block, names["block"])
    _one_of(f"{p}.attention_impl", c.attention_impl, names["attention_impl"])
    _one_of(f"{p}.context_parallel", c.context_parallel, ("ring", "all_gather"))
    _one_of(f"{p}.zigzag", c.zigzag, ("data", "layer", "none"))
    _one_of(f"{p}.remat", c.remat, names["remat"])
    _one_of(f"{p}.dtype", c.dtype, DTYPES)
    _one_of(f"{p}.param_dtype", c.param_dtype, DTYPES)

    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                 "norm_eps", "init_std"):
        _positive(f"{p}.{name}", getattr(c, name))
    for name in ("num_encoder_layers", "num_kv_heads", "head_dim", "attn_scale", "attn_softcap",
                 "final_softcap", "sliding_window", "type_vocab_size", "num_classes"):
        _non_negative(f"{p}.{name}", getattr(c, name))
    _positive(f"{p}.logits_scale", c.logits_scale)
    if not 0.0 <= c.dropout_rate < 1.0:
        _fail(f"{p}.dropout_rate", f"must be in [0, 1), got {c.dropout_rate!r}")

    if not c.head_dim and c.d_model % c.num_heads:
        _fail(f"{p}.d_model", f"{c.d_model} is not divisible by num_heads={c.num_heads}; "
              "change one of them or set model.head_dim explicitly")
    if c.num_heads % c.kv_heads:
        _fail(f"{p}.num_kv_heads", f"num_heads={c.num_heads} is not divisible by "
              f"num_kv_heads={c.kv_heads}; use a divisor of num_heads (1 = MQA)")

    if not c.layer_pattern:
        _fail(f"{p}.layer_pattern", "must name at least one layer kind, e.g. ('global',)")
    for i, kind in enumerate(c.layer_pattern):
        _one_of(f"{p}.layer_pattern[{i}]", kind, names["layer_kind"])
    _validate_beyond_dense(c, p, names)
    if "local" in c.layer_pattern and c.sliding_window < 1:
        _fail(f"{p}.sliding_window", f"must be >= 1 when layer_pattern has 'local' layers, "
              f"got {c.sliding_window}")

    if c.position == "rope":
        r, rp = c.rope, f"{p}.rope"
        _one_of(f"{rp}.layout", r.layout, ROPE_LAYOUTS)
        _one_of(f"{rp}.scaling", r.scaling, names["rope_scaling"])
        _positive(f"{rp}.theta", r.theta)
        if not 0.0 < r.fraction <= 1.0:
            _fail(f"{rp}.fraction", f"must be in (0, 1], got {r.fraction!r}")
        rotary = r.fraction * c.head_size
        if rotary != int(rotary) or int(rotary) % 2:
            _fail(f"{rp}.fraction", f"rotary dims = fraction * head_dim = {rotary:g} must be an "
                  f"even integer (head_dim={c.head_size})")
        if r.factor < 1.0:
            _fail(f"{rp}.factor", f"must be >= 1 (the context extension factor), got {r.factor!r}")
        if r.scaling != "none" and r.factor == 1.0 and r.scaling != "dynamic_ntk":
            _fail(f"{rp}.factor", f"scaling={r.scaling!r} needs factor > 1, got 1.0")
        _positive(f"{rp}.original_max_len", r.original_max_len)
        if r.scaling == "llama3" and r.high_freq_factor <= r.low_freq_factor:
            _fail(f"{rp}.high_freq_factor", "must be > rope.low_freq_factor")
        if r.scaling == "yarn" and r.beta_fast <= r.beta_slow:
            _fail(f"{rp}.beta_fast", "must be > rope.beta_slow")
    if c.block == "parallel" and c.norm_placement != "pre":
        _fail(f"{p}.norm_placement", f"block='parallel' needs norm_placement='pre', got "
              f"{c.norm_placement!r}")
    if c.block == "parallel" and c.arch == "encoder_decoder":
        _fail(f"{p}.block", "an encoder-decoder needs block='sequential' (its decoder "
              "blocks have cross-attention)")
    if c.position == "t5":
        _positive(f"{p}.t5_num_buckets", c.t5_num_buckets)
        _positive(f"{p}.t5_max_distance", c.t5_max_distance)

    if c.arch != "decoder" and c.prefix_lm:
        _fail(f"{p}.prefix_lm", f"only a decoder-only model has a prefix-LM mode (arch={c.arch!r})")
    if c.arch != "encoder":
        if c.type_vocab_size:
            _fail(f"{p}.type_vocab_size", f"token types are for arch='encoder' (arch={c.arch!r})")
        if c.num_classes:
            _fail(f"{p}.num_classes", f"a classification head is for arch='encoder' (arch={c.arch!r})")
    if c.arch != "encoder_decoder" and c.num_encoder_layers:
        _fail(f"{p}.num_encoder_layers", f"only arch='encoder_decoder' has a separate encoder "
              f"(arch={c.arch!r}); use num_layers")


def _validate_beyond_dense(c: ModelConfig, p: str, names: dict) -> None:
    """ffn_pattern, MoE, Mamba and linear attention fields."""
    from tfjax.nn.moe import MOE_IMPLEMENTATIONS

    if not c.ffn_pattern:
        _fail(f"{p}.ffn_pattern", "must name at least one ffn kind, e.g. ('dense',)")
    for i, kind in enumerate(c.ffn_pattern):
        _one_of(f"{p}.ffn_pattern[{i}]", kind, names["ffn_kind"])
    for name in ("moe_d_ff", "shared_experts", "capacity_factor", "moe_aux_loss_weight",
                 "moe_z_loss_weight", "ssm_dt_rank", "ssm_chunk"):
        _non_negative(f"{p}.{name}", getattr(c, name))
    for name in ("ssm_d_state", "ssm_d_conv", "ssm_expand", "linear_chunk"):
        _positive(f"{p}.{name}", getattr(c, name))
    _one_of(f"{p}.moe_impl", c.moe_impl, MOE_IMPLEMENTATIONS)
    _one_of(f"{p}.linear_feature_map", c.linear_feature_map, names["feature_map"])
    if "moe" in c.ffn_pattern:
        if c.num_experts < 1:
            _fail(f"{p}.num_experts", f"ffn_pattern has 'moe' layers: set num_experts >= 1, "
                  f"got {c.num_experts}")
        if not 1 <= c.experts_per_token <= c.num_experts:
            _fail(f"{p}.experts_per_token", f"must be in [1, num_experts={c.num_experts}], "
                  f"got {c.experts_per_token}")
    sequence_mixers = sorted({"mamba", "linear"} & set(c.layer_pattern))
    if sequence_mixers and c.arch != "decoder":
        _fail(f"{p}.layer_pattern", f"{', '.join(map(repr, sequence_mixers))} layers are causal "
              f"mixers for arch='decoder' (arch={c.arch!r})")


def _validate_train(c: TrainConfig, p: str) -> None:
    for name in ("steps", "batch_size", "seq_len", "microbatches", "lr", "log_every", "eps"):
        _positive(f"{p}.{name}", getattr(c, name))
    for name in ("warmup_steps", "weight_decay", "grad_clip", "z_loss", "eval_every",
                 "eval_batches", "sample_tokens", "peak_flops"):
        _non_negative(f"{p}.{name}", getattr(c, name))
    _one_of(f"{p}.schedule", c.schedule, SCHEDULES)
    if not 0.0 <= c.lr_min_ratio <= 1.0:
        _fail(f"{p}.lr_min_ratio", f"must be in [0, 1], got {c.lr_min_ratio!r}")
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(c, name) < 1.0:
            _fail(f"{p}.{name}", f"must be in [0, 1), got {getattr(c, name)!r}")
    if c.batch_size % c.microbatches:
        _fail(f"{p}.batch_size", f"{c.batch_size} is not divisible by train.microbatches="
              f"{c.microbatches}; use a multiple of it")


def _validate_data(c: DataConfig, p: str) -> None:
    _one_of(f"{p}.source", c.source, DATA_SOURCES)
    if c.source == "stdlib" and (c.paths or c.val_paths):
        _fail(f"{p}.paths", "the stdlib corpus takes no paths; set data.source='text' or "
              "'jsonl' to read your own files")
    if c.source in ("text", "jsonl") and not c.paths:
        _fail(f"{p}.paths", f"data.source={c.source!r} needs files or globs, e.g. "
              "--config.data.paths=\"('corpus/*.txt',)\"")
    if not c.tokenizer:
        _fail(f"{p}.tokenizer", "use 'byte' or a path to a tokenizers .json / sentencepiece .model")
    if c.source == "jsonl" and not c.jsonl_field:
        _fail(f"{p}.jsonl_field", "name the JSON field that holds the text, e.g. 'text'")


def _validate_mesh(c: MeshConfig, p: str) -> None:
    fill = [a for a in MESH_AXES if getattr(c, a) == -1]
    for a in MESH_AXES:
        v = getattr(c, a)
        if v != -1 and v < 1:
            _fail(f"{p}.{a}", f"must be >= 1, or -1 to take the remaining devices, got {v}")
    if len(fill) > 1:
        _fail(f"{p}.{fill[1]}", f"only one mesh axis may be -1 (fill the rest); "
              f"{', '.join(fill)} are; give all but one a size")
    seen: set[str] = set()
    for i, rule in enumerate(c.rules):
        f = f"{p}.rules[{i}]"
        if not rule or not isinstance(rule[0], str) or not rule[0]:
            _fail(f, f"each rule is (logical_name, *mesh_axes), got {rule!r}")
        if rule[0] in seen:
            _fail(f, f"logical axis {rule[0]!r} appears twice; keep one rule per name")
        seen.add(rule[0])
        for axis in rule[1:]:
            if axis not in MESH_AXES:
                _fail(f, f"unknown mesh axis {axis!r} for {rule[0]!r}; mesh axes: "
                      f"{', '.join(MESH_AXES)}")
        if len(set(rule[1:])) != len(rule[1:]):
            _fail(f, f"mesh axis repeated in {rule!r}")


def _validate_checkpoint(c: CheckpointConfig, p: str) -> None:
    _non_negative(f"{p}.every_steps", c.every_steps)
    _positive(f"{p}.keep", c.keep)


# --------------------------------------------------------------------------- #
# ConfigDict <-> dataclass.
# --------------------------------------------------------------------------- #


def _convert(field: str, tp: Any, value: Any) -> Any:
    """Coerce one value to a dataclass field type, or fail naming the field."""
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=field)
    origin = typing.get_origin(tp)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            _fail(field, f"expected a tuple, got {value!r}")
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(_convert(f"{field}[{i}]", item, v) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if not isinstance(value, bool):
            _fail(field, f"expected True or False, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(field, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(field, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(field, f"expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type, values: Mapping[str, Any] | ml_collections.ConfigDict | None,
              prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and bad types name the field."""
    if values is None:
        return cls()
    if dataclasses.is_dataclass(values):
        return values
    if isinstance(values, ml_collections.ConfigDict):
        values = values.to_dict()
    if not isinstance(values, Mapping):
        _fail(prefix or cls.__name__, f"expected a mapping of fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = [f for f in fields if f.startswith(key[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            _fail(name, f"unknown field{hint}; fields of {cls.__name__}: {', '.join(sorted(fields))}")
        kwargs[key] = _convert(name, hints[key], value)
    return cls(**kwargs)


def model_config(cfg: Mapping[str, Any] | ml_collections.ConfigDict | ModelConfig) -> ModelConfig:
    """`cfg.model` (a ConfigDict or dict) -> a validated, frozen `ModelConfig`."""
    c = cfg if isinstance(cfg, ModelConfig) else from_dict(ModelConfig, cfg, prefix="model")
    return c.validate()


def run_config(cfg: Mapping[str, Any] | ml_collections.ConfigDict | RunConfig) -> RunConfig:
    """A whole preset (`get_config(...)`) -> a validated, frozen `RunConfig`."""
    c = cfg if isinstance(cfg, RunConfig) else from_dict(RunConfig, cfg)
    return c.validate()


def default_config() -> ml_collections.ConfigDict:
    """The defaults of every section as a ConfigDict; presets start here and override."""
    return to_config_dict(RunConfig())


def apply_variant(cfg: ml_collections.ConfigDict, arg: str | None,
                  variants: Mapping[str, Mapping[str, Any]]) -> ml_collections.ConfigDict:
    """Presets' `get_config(arg)`: apply the overrides of variant `arg` (None = the
    preset's default). Overrides are nested dicts, e.g. {"model": {"num_layers": 2}}."""
    if arg is None or arg == "":
        return cfg
    if arg not in variants:
        raise ValueError(f"unknown preset variant {arg!r}; allowed: {', '.join(sorted(variants))} "
                         "(or none for the full-size default)")

    def merge(node, overrides, where):
        for key, value in overrides.items():
            if key not in node:
                raise ValueError(f"preset variant {arg!r}: {where}{key} is not a config field")
            if isinstance(value, Mapping):
                merge(node[key], value, f"{where}{key}.")
            else:
                node[key] = value

    merge(cfg, variants[arg], "")
    return cfg


def to_config_dict(obj: Any) -> ml_collections.ConfigDict:
    """A dataclass -> ConfigDict (presets start from the defaults and override)."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return x

    return ml_collections.ConfigDict(plain(obj))
