"""The model's config: `ModelConfig` and its sections (`rope`, `moe`, `ssm`,
`mamba2`, `linear`, `gdn`, `mla`, `t5`; `attention` lives in `tfjax.config.attention`,
`shared` in `tfjax.config.shared`, `vision` in `tfjax.config.vision`), frozen
dataclasses, and their checks.

`validate_model` checks types, ranges and combinations of fields (each error names
the field, `model.num_kv_heads`, and what would be right). Names that a registry
owns (architectures, activations, norms, positions, rope scalings, blocks, layer
and ffn kinds, feature maps, attention and MoE implementations, remat policies)
are not known here: `tfjax.models.build` checks them against the registries before
it builds anything (`tfjax.models.check_names`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from tfjax.config.attention import MOVED as ATTENTION_MOVED
from tfjax.config.attention import AttentionConfig, validate_attention
from tfjax.config.audio import AudioConfig, validate_audio
from tfjax.config.checks import fail, non_negative, one_of, positive
from tfjax.config.shared import SharedBlockConfig, validate_shared
from tfjax.config.vision import VisionConfig, validate_vision

__all__ = ["DTYPES", "GatedDeltaNetConfig", "LinearConfig", "MLAConfig", "Mamba2Config",
           "ModelConfig", "MoEConfig", "RopeConfig", "SSMConfig", "T5Config", "validate_model"]

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding (Su et al. 2021) and its context-extension scalings.

    layout: "half" rotates (x[:h/2], x[h/2:]) pairs (GPT-NeoX, Llama); "interleaved"
      rotates (x[2i], x[2i+1]) pairs (GPT-J, the paper).
    fraction: share of the head dim that is rotated (partial rotary: NeoX 0.25).
    scaling: none | linear (position interpolation, Chen et al. 2023) | ntk
      (NTK-aware base change) | dynamic_ntk (NTK base grown with the length seen)
      | yarn (Peng et al. 2023, with its attention temperature) | llama3 | longrope
      (Ding et al. 2024, Phi-3: per-pair factors, cos/sin times
      sqrt(1 + ln s / ln original_max_len)).
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
    truncate: bool = True  # yarn: ramp edges rounded out to whole pairs; False: exact (gpt-oss)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # longrope (LongRoPE, Phi-3): per-pair frequency divisors, short_factor while the
    # longest position seen is within original_max_len, long_factor beyond it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A routed Mixture of Experts (`tfjax.nn.moe`): the "moe" entries of `ffn_pattern`."""

    num_experts: int = 0  # experts per "moe" layer
    experts_per_token: int = 2  # top-k
    d_ff: int = 0  # one expert's hidden width; 0 -> model.d_ff
    shared_experts: int = 0  # always-on experts added to the routed ones (each d_ff wide)
    router_renormalize: bool = True  # top-k gates renormalised to sum 1 (Mixtral) or raw (Jamba)
    capacity_factor: float = 0.0  # 0 -> dropless; else C = ceil(cf * T * k / E) slots per sequence
    impl: str = "ragged"  # dropless dispatch: ragged (grouped matmul) | dense (every expert)
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch), 1.0 when balanced
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
    # Routers of the 2024-26 families (docs/layers.md, "Routers").
    score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3, Llama 4)
    n_group: int = 1  # DeepSeek-V3 group-limited top-k: experts in n_group groups ...
    topk_group: int = 1  # ... of which the top topk_group (by their top-2 scores) are kept
    score_bias: bool = False  # e_score_correction_bias: added for choosing experts, not gates
    bias_update_rate: float = 0.0  # aux-loss-free balancing gamma (DeepSeek-V3 0.001); 0 = off
    routed_scaling_factor: float = 1.0  # gates multiplied by this (DeepSeek-V3 2.5)
    router_bias: bool = False  # bias on the router logits (gpt-oss)
    glu: str = "standard"  # standard | clamped (gpt-oss SwiGLU: (clip(up)+1) * g sigmoid(a g))
    glu_alpha: float = 1.702  # clamped: alpha
    glu_limit: float = 7.0  # clamped: gate <= limit, |up| <= limit
    gate_input: bool = False  # Llama 4: the gate scales the expert's input, not its output
    shared_d_ff: int = 0  # one shared expert's width; 0 -> moe.d_ff (then model.d_ff)
    shared_gate: bool = False  # Qwen2-MoE / Qwen3-Next: shared(x) * sigmoid(x @ [D, 1])


@dataclasses.dataclass(frozen=True)
class SSMConfig:
    """The Mamba selective SSM mixer (`tfjax.nn.ssm`): the "mamba" layers."""

    d_state: int = 16  # state size N
    d_conv: int = 4  # depthwise causal conv width
    expand: int = 2  # inner width = expand * d_model
    dt_rank: int = 0  # 0 -> ceil(d_model / 16)
    chunk: int = 0  # 0 -> one associative scan over T; else chunks of this many steps
    conv_bias: bool = True
    proj_bias: bool = False  # in/out projection biases
    inner_norm: bool = False  # RMSNorm on dt, B, C (Jamba)


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """The Mamba-2 SSD mixer (`tfjax.nn.mamba2`): the "mamba2" layers. Heads H =
    expand * d_model / head_dim, each with a scalar decay; B and C shared by the
    heads of each of n_groups groups."""

    d_state: int = 16  # state size N (Mamba-2 models: 64-128)
    head_dim: int = 16  # head dim P (Mamba-2 models: 64)
    expand: int = 2  # inner width = expand * d_model
    n_groups: int = 1  # groups of B and C (must divide the heads)
    d_conv: int = 4  # depthwise causal conv width over (x, B, C)
    chunk: int = 64  # SSD chunk length (the quadratic form within, a scan across)
    conv_bias: bool = True
    proj_bias: bool = False  # in/out projection biases
    norm_groups: int = 0  # groups of the gated RMSNorm; 0 -> n_groups (HF, mamba_ssm)
    dt_min: float = 0.001  # dt_bias init: softplus(dt_bias) log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1
    dt_min_limit: float = 0.0  # dt clipped to [dt_min_limit, dt_max_limit]
    dt_max_limit: float = 0.0  # 0 -> no upper limit


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Causal linear attention (`tfjax.nn.linear_attention`): the "linear" layers."""

    feature_map: str = "elu_plus_one"  # phi: elu_plus_one | relu | softplus
    chunk: int = 64  # causal linear attention chunk


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet (`tfjax.nn.gated_deltanet`; Qwen3-Next's linear-attention layers):
    the "gated_deltanet" layers. Zero derives from the model (`dims`)."""

    num_k_heads: int = 0  # q/k heads; 0 -> model.num_heads (Qwen3-Next: 16)
    num_v_heads: int = 0  # a multiple of num_k_heads; 0 -> num_k_heads (Qwen3-Next: 32)
    head_k_dim: int = 0  # 0 -> model.head_dim (d_model // num_heads) (Qwen3-Next: 128)
    head_v_dim: int = 0  # 0 -> head_k_dim (Qwen3-Next: 128)
    d_conv: int = 4  # causal depthwise conv width on q, k, v
    chunk: int = 64  # chunked (WY) training form: steps per chunk

    def dims(self, num_heads: int, head_size: int) -> tuple[int, int, int, int]:
        """(num_k_heads, num_v_heads, head_k_dim, head_v_dim) with zeros derived."""
        hk = self.num_k_heads or num_heads
        dk = self.head_k_dim or head_size
        return hk, self.num_v_heads or hk, dk, self.head_v_dim or dk

    def resolved(self, num_heads: int, head_size: int) -> "GatedDeltaNetConfig":
        """This section with its zeros derived (`dims`): what the layer takes."""
        hk, hv, dk, dv = self.dims(num_heads, head_size)
        return dataclasses.replace(self, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
                                   head_v_dim=dv)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3; `tfjax.nn.latent_attention`): the
    "mla" layers. Their RoPE (model.rope) rotates the qk_rope_head_dim part only."""

    q_lora_rank: int = 0  # low-rank query (V3: 1536); 0 -> a full-rank query projection
    kv_lora_rank: int = 32  # the cached latent's width r (V3: 512)
    qk_nope_head_dim: int = 16  # per-head query/key dims without RoPE (V3: 128)
    qk_rope_head_dim: int = 8  # the decoupled rotary dims, one key for all heads (V3: 64)
    v_head_dim: int = 16  # per-head value dims (V3: 128)
    # DeepSeek's YaRN softmax scale: scale *= (0.1 * mscale_all_dim * ln(rope.factor) + 1)^2
    # when rope.scaling == "yarn" (V3: 1.0); 0 -> none
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5's bucketed relative position bias (`model.position="t5"`)."""

    num_buckets: int = 32
    max_distance: int = 128


# The flat fields these sections replaced: an old path is an error naming the new one.
_MOVED = {
    "num_experts": "moe.num_experts", "experts_per_token": "moe.experts_per_token",
    "moe_d_ff": "moe.d_ff", "shared_experts": "moe.shared_experts",
    "router_renormalize": "moe.router_renormalize", "capacity_factor": "moe.capacity_factor",
    "moe_impl": "moe.impl", "moe_aux_loss_weight": "moe.aux_loss_weight",
    "moe_z_loss_weight": "moe.z_loss_weight",
    "ssm_d_state": "ssm.d_state", "ssm_d_conv": "ssm.d_conv", "ssm_expand": "ssm.expand",
    "ssm_dt_rank": "ssm.dt_rank", "ssm_chunk": "ssm.chunk", "ssm_conv_bias": "ssm.conv_bias",
    "ssm_proj_bias": "ssm.proj_bias", "ssm_inner_norm": "ssm.inner_norm",
    "linear_feature_map": "linear.feature_map", "linear_chunk": "linear.chunk",
    "t5_num_buckets": "t5.num_buckets", "t5_max_distance": "t5.max_distance",
    **ATTENTION_MOVED,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architecture knob of tfjax. Zero means "derive" or "off" where noted."""

    MOVED: ClassVar[dict[str, str]] = _MOVED  # old flat field -> its path now

    arch: str = "decoder"  # decoder | encoder | encoder_decoder | vision
    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2  # decoder layers (encoder layers for arch="encoder")
    num_encoder_layers: int = 0  # encoder_decoder only; 0 -> num_layers
    num_heads: int = 4
    num_kv_heads: int = 0  # 0 -> num_heads (MHA); 1 -> MQA; else GQA
    head_dim: int = 0  # 0 -> d_model // num_heads
    v_head_dim: int = 0  # values' head dim; 0 -> head_dim (DeepSeek: 128 against 192)
    d_ff: int = 256
    max_len: int = 2048  # learned / sinusoidal position tables

    # Feed-forward.
    activation: str = "gelu"  # relu | gelu | gelu_tanh | silu | reglu | geglu | geglu_tanh | swiglu
    ffn_bias: bool = True

    # Attention: how the attention layers attend (tfjax.config.attention).
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    # Layer kinds (tfjax.models.layer_kinds), cycled over layers: global | local |
    # chunked | nope | mla | mamba | mamba2 | mamba2_shared (model.shared) | linear |
    # gated_deltanet (chunked and the recurrent kinds decoder only).
    layer_pattern: tuple[str, ...] = ("global",)
    prefix_lm: bool = False  # decoder: bidirectional over a prefix given at call time
    # What follows the mixer, cycled over layers independently of layer_pattern:
    # dense | moe | none. The scanned unit is lcm(len(layer_pattern), len(ffn_pattern)).
    ffn_pattern: tuple[str, ...] = ("dense",)

    # Mixer sections.
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    ssm: SSMConfig = dataclasses.field(default_factory=SSMConfig)
    mamba2: Mamba2Config = dataclasses.field(default_factory=Mamba2Config)
    linear: LinearConfig = dataclasses.field(default_factory=LinearConfig)
    gdn: GatedDeltaNetConfig = dataclasses.field(default_factory=GatedDeltaNetConfig)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    shared: SharedBlockConfig = dataclasses.field(default_factory=SharedBlockConfig)

    # Positions.
    position: str = "rope"  # none | sinusoidal | learned | rope | alibi | t5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    t5: T5Config = dataclasses.field(default_factory=T5Config)
    # Images (tfjax.config.vision): the vision encoder's input and pooling, a tower's size
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    # Whisper's audio front end before the encoder (tfjax.config.audio); n_mels 0 -> off
    audio: AudioConfig = dataclasses.field(default_factory=AudioConfig)

    # Norms and blocks.
    norm: str = "layernorm"  # layernorm | rmsnorm | rmsnorm_plus_one
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    norm_placement: str = "pre"  # pre | post | sandwich | output (OLMo 2)
    final_norm: bool = True  # norm after the last block (pre/sandwich models)
    embed_norm: bool = False  # norm after the embeddings (BLOOM, BERT)
    # True: layer 0's attn_norm also normalises the residual stream, x <- attn_norm(x),
    # x + attn(x) (pre norm, sequential block): ModernBERT's embedding norm before a
    # layer 0 that has no attention norm of its own
    first_norm_residual: bool = False
    block: str = "sequential"  # sequential | parallel (PaLM, GPT-J, NeoX)
    parallel_shared_norm: bool = True  # parallel block: one norm (GPT-J) or two (NeoX)

    # Embeddings and output.
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply embeddings by sqrt(d_model)
    final_softcap: float = 0.0  # 0 -> off; Gemma 2: 30
    logits_scale: float = 1.0  # multiply the final hidden state before the output projection
    # DeepSeek-V3's multi-token prediction (tfjax.models.mtp): D sequential modules
    # predicting tokens i+2..i+D+1, their loss weighted by mtp_loss_weight / D;
    # decoder only; the draft of tfjax.inference.speculative
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    type_vocab_size: int = 0  # encoder: token-type (segment A/B) embeddings; 0 -> none
    num_classes: int = 0  # encoder: classification head on the pooled [CLS]; 0 -> none
    # encoder: biases of the MLM head's dense layer and of its logits (BERT: both;
    # ModernBERT: classifier_bias, decoder_bias)
    mlm_dense_bias: bool = True
    mlm_output_bias: bool = True

    # Numerics and structure.
    dropout_rate: float = 0.0  # residual and embedding dropout
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    init_std: float = 0.02
    # μP (tfjax.models.mup): the base width whose standard model this one scales (init,
    # per-class Adam learning rates, logits x base/d_model, attention 1/head_dim); 0 = off
    mup_base_width: int = 0
    mup_base_head_dim: int = 0  # the base model's head dim; 0 -> head_dim * base / d_model
    scan_layers: bool = True  # scan over repeats of layer_pattern (compile time flat in depth)
    # activation checkpointing per layer (tfjax.models.stack.REMAT_POLICIES): none | full |
    # dots | dots_no_batch | attn | qkv_attn | dots_attn | attn_offload | qkv_attn_offload
    remat: str = "none"
    # Quantized training (tfjax.nn.quant, docs/quantization.md): none | int8 | fp8 on the
    # matmuls of the modules whose path fully matches quant_paths and not quant_exclude
    quant: str = "none"
    quant_paths: str = r"(.*/)?layers/.*"
    quant_exclude: str = ""
    # An 8-bit K/V cache for decoding (tfjax.ops.kv_quant, docs/quantization.md): none |
    # int8 | fp8, one scale per token and kv head; the model's weights are unchanged
    kv_quant: str = "none"

    # Derived values ----------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def value_head_size(self) -> int:
        return self.v_head_dim or self.head_size

    @property
    def encoder_layers(self) -> int:
        return self.num_encoder_layers or self.num_layers

    @property
    def attention_scale(self) -> float:
        """The attention's softmax scale: 1/sqrt of the q.k width, head_dim or its half
        with attention.differential (or `attention.scale`); with μP that scale at the
        base head dim, times base / head dim."""
        a = self.attention
        width = self.head_size // (2 if a.differential else 1)
        if not self.mup_base_width:
            return a.scale or 1.0 / math.sqrt(width)
        base = (self.mup_base_head_dim or self.head_size * self.mup_base_width / self.d_model)
        base /= 2 if a.differential else 1
        return (a.scale or 1.0 / math.sqrt(base)) * base / width

    @property
    def logits_multiplier(self) -> float:
        """What the final hidden state is multiplied by before the output projection:
        `logits_scale`, times base / d_model with μP (its readout multiplier)."""
        if not self.mup_base_width:
            return self.logits_scale
        return self.logits_scale * self.mup_base_width / self.d_model

    def ffn_kind(self, i: int) -> str:
        return self.ffn_pattern[i % len(self.ffn_pattern)]

    def layer_kind(self, i: int) -> str:
        return self.layer_pattern[i % len(self.layer_pattern)]

    def validate(self) -> "ModelConfig":
        validate_model(self, "model")
        return self


def validate_model(c: ModelConfig, p: str) -> None:
    """Types were checked on conversion; here ranges and combinations."""
    one_of(f"{p}.dtype", c.dtype, DTYPES)
    one_of(f"{p}.param_dtype", c.param_dtype, DTYPES)
    one_of(f"{p}.quant", c.quant, ("none", "int8", "fp8"))
    one_of(f"{p}.kv_quant", c.kv_quant, ("none", "int8", "fp8"))

    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
                 "norm_eps", "init_std"):
        positive(f"{p}.{name}", getattr(c, name))
    for name in ("mup_base_width", "mup_base_head_dim"):
        non_negative(f"{p}.{name}", getattr(c, name))
    for name in ("num_encoder_layers", "num_kv_heads", "head_dim", "v_head_dim",
                 "final_softcap", "type_vocab_size", "num_classes", "mtp_depth",
                 "mtp_loss_weight"):
        non_negative(f"{p}.{name}", getattr(c, name))
    if c.mtp_depth and (c.arch != "decoder" or c.prefix_lm):
        fail(f"{p}.mtp_depth", f"multi-token prediction is for causal decoders (arch="
             f"'decoder', prefix_lm=False); got arch={c.arch!r}, prefix_lm={c.prefix_lm}; "
             "set model.mtp_depth=0")
    positive(f"{p}.logits_scale", c.logits_scale)
    if not 0.0 <= c.dropout_rate < 1.0:
        fail(f"{p}.dropout_rate", f"must be in [0, 1), got {c.dropout_rate!r}")

    if not c.head_dim and c.d_model % c.num_heads:
        fail(f"{p}.d_model", f"{c.d_model} is not divisible by num_heads={c.num_heads}; "
             "change one of them or set model.head_dim explicitly")
    if c.num_heads % c.kv_heads:
        fail(f"{p}.num_kv_heads", f"num_heads={c.num_heads} is not divisible by "
             f"num_kv_heads={c.kv_heads}; use a divisor of num_heads (1 = MQA)")

    if not c.layer_pattern:
        fail(f"{p}.layer_pattern", "must name at least one layer kind, e.g. ('global',)")
    if not c.ffn_pattern:
        fail(f"{p}.ffn_pattern", "must name at least one ffn kind, e.g. ('dense',)")
    validate_attention(c, p)
    _validate_sections(c, p)
    validate_shared(c, p)
    validate_vision(c, p)

    if c.position == "rope":
        r, rp = c.rope, f"{p}.rope"
        positive(f"{rp}.theta", r.theta)
        if not 0.0 < r.fraction <= 1.0:
            fail(f"{rp}.fraction", f"must be in (0, 1], got {r.fraction!r}")
        rotary = r.fraction * c.head_size
        if rotary != int(rotary) or int(rotary) % 2:
            fail(f"{rp}.fraction", f"rotary dims = fraction * head_dim = {rotary:g} must be an "
                 f"even integer (head_dim={c.head_size})")
        if r.factor < 1.0:
            fail(f"{rp}.factor", f"must be >= 1 (the context extension factor), got {r.factor!r}")
        if r.scaling != "none" and r.factor == 1.0 and r.scaling not in ("dynamic_ntk",
                                                                          "longrope"):
            fail(f"{rp}.factor", f"scaling={r.scaling!r} needs factor > 1, got 1.0")
        positive(f"{rp}.original_max_len", r.original_max_len)
        if r.scaling == "llama3" and r.high_freq_factor < r.low_freq_factor:
            fail(f"{rp}.high_freq_factor", "must be >= rope.low_freq_factor")
        if r.scaling == "yarn" and r.beta_fast <= r.beta_slow:
            fail(f"{rp}.beta_fast", "must be > rope.beta_slow")
        for name in ("short_factor", "long_factor"):
            factors = getattr(r, name)
            if r.scaling == "longrope" and (len(factors) * 2 != int(rotary)
                                            or not all(f > 0 for f in factors)):
                fail(f"{rp}.{name}", f"longrope needs rotary dims / 2 = {int(rotary) // 2} "
                     f"positive factors, got {len(factors)}")
    if c.block == "parallel" and c.norm_placement != "pre":
        fail(f"{p}.norm_placement", f"block='parallel' needs norm_placement='pre', got "
             f"{c.norm_placement!r}")
    if c.first_norm_residual and (c.norm_placement != "pre" or c.block != "sequential"):
        fail(f"{p}.first_norm_residual", "needs norm_placement='pre' and block='sequential' "
             f"(layer 0's pre-attention norm), got {c.norm_placement!r}, {c.block!r}")
    if c.block == "parallel" and c.arch == "encoder_decoder":
        fail(f"{p}.block", "an encoder-decoder needs block='sequential' (its decoder "
             "blocks have cross-attention)")
    if c.position == "t5":
        positive(f"{p}.t5.num_buckets", c.t5.num_buckets)
        positive(f"{p}.t5.max_distance", c.t5.max_distance)

    if c.arch != "decoder" and c.prefix_lm:
        fail(f"{p}.prefix_lm", f"only a decoder-only model has a prefix-LM mode (arch={c.arch!r})")
    if c.arch != "encoder":
        if c.type_vocab_size:
            fail(f"{p}.type_vocab_size", f"token types are for arch='encoder' (arch={c.arch!r})")
        if c.num_classes:
            fail(f"{p}.num_classes", f"a classification head is for arch='encoder' (arch={c.arch!r})")
    if c.arch != "encoder_decoder" and c.num_encoder_layers:
        fail(f"{p}.num_encoder_layers", f"only arch='encoder_decoder' has a separate encoder "
             f"(arch={c.arch!r}); use num_layers")
    validate_audio(c, p)


def _validate_mamba2(c: ModelConfig, p: str) -> None:
    """The mamba2 section's ranges, and the head and group divisibility "mamba2"
    layers need."""
    m2, q = c.mamba2, f"{p}.mamba2"
    for name in ("d_state", "head_dim", "expand", "n_groups", "d_conv", "chunk", "dt_min",
                 "dt_max"):
        positive(f"{q}.{name}", getattr(m2, name))
    for name in ("norm_groups", "dt_min_limit", "dt_max_limit"):
        non_negative(f"{q}.{name}", getattr(m2, name))
    if m2.dt_max < m2.dt_min:
        fail(f"{q}.dt_max", f"must be >= dt_min={m2.dt_min!r}, got {m2.dt_max!r}")
    if m2.dt_max_limit and m2.dt_max_limit <= m2.dt_min_limit:
        fail(f"{q}.dt_max_limit", f"must be > dt_min_limit={m2.dt_min_limit!r} (or 0: no upper "
             f"limit), got {m2.dt_max_limit!r}")
    if not {"mamba2", "mamba2_shared"} & set(c.layer_pattern):
        return
    inner = m2.expand * c.d_model
    if inner % m2.head_dim:
        fail(f"{q}.head_dim", f"must divide the inner width expand * d_model = {inner}, got "
             f"{m2.head_dim}")
    heads = inner // m2.head_dim
    if heads % m2.n_groups:
        fail(f"{q}.n_groups", f"must divide the heads expand * d_model / head_dim = {heads}, "
             f"got {m2.n_groups}")
    if inner % (m2.norm_groups or m2.n_groups):
        fail(f"{q}.norm_groups", f"must divide the inner width {inner}, got {m2.norm_groups}")


def _validate_sections(c: ModelConfig, p: str) -> None:
    """The moe, ssm, linear, gdn and mla sections' ranges, and what "moe" and "mla"
    layers need."""
    m, s, lin = c.moe, c.ssm, c.linear
    for name in ("d_ff", "shared_experts", "capacity_factor", "aux_loss_weight", "z_loss_weight",
                 "bias_update_rate", "shared_d_ff", "glu_alpha", "glu_limit"):
        non_negative(f"{p}.moe.{name}", getattr(m, name))
    for name in ("n_group", "topk_group"):
        positive(f"{p}.moe.{name}", getattr(m, name))
    for name in ("dt_rank", "chunk"):
        non_negative(f"{p}.ssm.{name}", getattr(s, name))
    for name in ("d_state", "d_conv", "expand"):
        positive(f"{p}.ssm.{name}", getattr(s, name))
    _validate_mamba2(c, p)
    positive(f"{p}.linear.chunk", lin.chunk)
    gdn = c.gdn
    for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
        non_negative(f"{p}.gdn.{name}", getattr(gdn, name))
    for name in ("d_conv", "chunk"):
        positive(f"{p}.gdn.{name}", getattr(gdn, name))
    hk, hv, _, _ = gdn.dims(c.num_heads, c.head_size)
    if hv % hk:
        fail(f"{p}.gdn.num_v_heads", f"must be a multiple of num_k_heads={hk} (each q/k head "
             f"serves num_v_heads / num_k_heads value heads), got {hv}")
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        positive(f"{p}.mla.{name}", getattr(c.mla, name))
    for name in ("q_lora_rank", "qk_nope_head_dim", "mscale_all_dim"):
        non_negative(f"{p}.mla.{name}", getattr(c.mla, name))
    if "mla" in c.layer_pattern:
        if c.position not in ("rope", "none"):
            fail(f"{p}.position", f"'mla' layers take their positions from RoPE on the decoupled "
                 f"part: use 'rope' (or 'none'), got {c.position!r}")
        if c.position == "rope" and c.rope.fraction != 1.0:
            fail(f"{p}.rope.fraction", "'mla' layers rotate all of mla.qk_rope_head_dim: "
                 f"use 1.0, got {c.rope.fraction!r}")
        if c.mla.qk_rope_head_dim % 2:
            fail(f"{p}.mla.qk_rope_head_dim", f"RoPE rotates pairs: must be even, got "
                 f"{c.mla.qk_rope_head_dim}")
    if "moe" in c.ffn_pattern:
        if m.num_experts < 1:
            fail(f"{p}.moe.num_experts", f"ffn_pattern has 'moe' layers: set num_experts >= 1, "
                 f"got {m.num_experts}")
        if not 1 <= m.experts_per_token <= m.num_experts:
            fail(f"{p}.moe.experts_per_token", f"must be in [1, num_experts={m.num_experts}], "
                 f"got {m.experts_per_token}")
        _validate_moe_routing(m, f"{p}.moe", c.activation)


def _validate_moe_routing(m: MoEConfig, q: str, activation: str) -> None:
    """The router options of "moe" layers (tfjax.nn.moe): names and how they combine."""
    for name, allowed in (("score", ("softmax", "sigmoid")), ("glu", ("standard", "clamped"))):
        if getattr(m, name) not in allowed:
            fail(f"{q}.{name}", f"must be one of {', '.join(allowed)}, got {getattr(m, name)!r}")
    if m.glu == "clamped" and activation != "swiglu":
        fail(f"{q}.glu", f"'clamped' is gpt-oss's SwiGLU: needs model.activation='swiglu', "
             f"got {activation!r}")
    if m.num_experts % m.n_group or (m.n_group > 1 and m.num_experts // m.n_group < 2):
        fail(f"{q}.n_group", f"must divide num_experts={m.num_experts} into groups of >= 2 "
             f"(a group scores its top-2), got {m.n_group}")
    if m.topk_group > m.n_group:
        fail(f"{q}.topk_group", f"must be in [1, n_group={m.n_group}], got {m.topk_group}")
    if m.experts_per_token > m.topk_group * (m.num_experts // m.n_group):
        fail(f"{q}.experts_per_token", f"the topk_group={m.topk_group} kept groups hold "
             f"{m.topk_group * (m.num_experts // m.n_group)} experts, got {m.experts_per_token}")
    if m.gate_input and m.capacity_factor > 0:
        fail(f"{q}.gate_input", "Llama 4's input gating needs dropless dispatch: set "
             "moe.capacity_factor=0")
    if m.shared_gate and not m.shared_experts:
        fail(f"{q}.shared_gate", "gates the shared expert: set moe.shared_experts >= 1")
