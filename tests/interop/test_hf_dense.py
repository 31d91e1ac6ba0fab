"""Parity of `tfjax.interop.hf.load` with transformers for the families of
`tfjax.interop.families` (Qwen2, OLMo 2, SmolLM3, Gemma 3 text, Phi-3, Qwen3-MoE): a
random tiny HF model is saved with `save_pretrained`, loaded by tfjax and compared on
fp32 logits (max |ours - theirs| <= 1e-4 * max |theirs|) and on 20 greedy tokens of
`tfjax.inference.generate` against HF `generate`; then `hf.export` writes it back
(the family's `to_hf` and its weights mapping inverted), transformers loads that with
the same logits and its config maps to the same tfjax config. Options beyond the
defaults throughout; those tfjax lacks are refused by name, bad values name the key."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from hf_parity import assert_greedy_equal, assert_logits_close  # noqa: E402
from tfjax.config import RopeConfig  # noqa: E402
from tfjax.inference import generate, stream  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file  # noqa: E402
from tfjax.nn.positions import RotaryEmbedding  # noqa: E402

V = 96
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
ROPE = dict(rope_type="default", rope_theta=100.0)

# name -> (HF config factory, HF model class name). The prompt is 10 tokens, so every
# window below is shorter than what the cached steps attend over.
CASES = {
    # q/k/v biases; layer 0 full, layers 1-2 slide over 4 keys (max_window_layers=1)
    "qwen2": (lambda: transformers.Qwen2Config(
        **BASE, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=100.0)),
        "Qwen2ForCausalLM"),
    # MHA, biases on q/k/v/o, QK-norm over the whole projections, output norms, tied
    "olmo2": (lambda: transformers.Olmo2Config(
        **dict(BASE, num_key_value_heads=4, tie_word_embeddings=True), attention_bias=True,
        rope_parameters=ROPE), "Olmo2ForCausalLM"),
    # NoPE every second layer (layers 1, 3), GQA 4/1, head 16, tied
    "smollm3": (lambda: transformers.SmolLM3Config(
        **dict(BASE, num_hidden_layers=4, num_key_value_heads=1, tie_word_embeddings=True),
        head_dim=16, no_rope_layer_interval=2, rope_parameters=ROPE), "SmolLM3ForCausalLM"),
    # sliding (window 4, base 10) / global (base 1000, linear x2) layers, a final
    # soft-cap, query_pre_attn_scalar != head_dim, untied; attn_logit_softcapping,
    # which transformers' Gemma 3 never applies, is not applied here either
    "gemma3_text": (lambda: transformers.Gemma3TextConfig(
        **dict(BASE, num_hidden_layers=2), head_dim=16, query_pre_attn_scalar=12,
        sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0,
                                                rope_theta=1000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10.0)}),
        "Gemma3ForCausalLM"),
    # fused qkv / gate_up, half the head rotated, every layer sliding over 5 keys
    "phi3": (lambda: transformers.Phi3Config(
        **BASE, sliding_window=5,
        rope_parameters=dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5)),
        "Phi3ForCausalLM"),
    # LongRoPE: the 10-token prompt past original_max_position_embeddings=8 (long
    # factors; the 6-token prefix is checked too: short ones), its attention factor
    # sqrt(1 + ln 8 / ln 8) on cos and sin
    "phi3_longrope": (lambda: transformers.Phi3Config(
        **BASE, original_max_position_embeddings=8, rope_parameters=dict(
            rope_type="longrope", rope_theta=100.0, short_factor=[1.0, 1.5, 2.0, 3.0],
            long_factor=[1.5, 3.0, 6.0, 12.0])), "Phi3ForCausalLM"),
    # layer 0 dense (mlp_only_layers), 1-2 routed: 4 experts of 16, top 2 renormalised
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, mlp_only_layers=[0], rope_parameters=ROPE),
        "Qwen3MoeForCausalLM"),
    # every second layer routed (decoder_sparse_step=2), raw top-3 gates, attention
    # biases, every layer sliding over 6 keys
    "qwen3_moe_step": (lambda: transformers.Qwen3MoeConfig(
        **dict(BASE, num_hidden_layers=4), num_experts=4, num_experts_per_tok=3,
        moe_intermediate_size=16, decoder_sparse_step=2, attention_bias=True,
        use_sliding_window=True, sliding_window=6, rope_parameters=ROPE),
        "Qwen3MoeForCausalLM"),
}
SHORT_PREFIX = {"phi3_longrope"}


def _save(name, path):
    make, cls = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # biases start at 0 and norm weights at 1 (or 0 for Gemma's
                p.add_(0.1 * torch.randn_like(p))  # 1 + w): a swapped one would go unnoticed
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name, tmp_path):
    ref = _save(name, tmp_path)
    model, cfg = hf.load(str(tmp_path))
    ids = np.random.default_rng(0).integers(3, V, size=(2, 10))
    t_ids = torch.tensor(ids)
    with torch.no_grad():
        assert_logits_close(model(jnp.asarray(ids)), ref(t_ids).logits)
        if name in SHORT_PREFIX:  # a length within the short regime of LongRoPE
            assert_logits_close(model(jnp.asarray(ids[:, :6])), ref(t_ids[:, :6]).logits)
    assert_greedy_equal(model, ref, ids)
    # Export round trip: transformers loads what export writes, with the same logits,
    # and its config maps back to the same tfjax config.
    out = tmp_path / "export"
    hf.export(model, str(out), family=ref.config.model_type)
    again = type(ref).from_pretrained(str(out), attn_implementation="eager").eval()
    with torch.no_grad():
        assert_logits_close(model(jnp.asarray(ids)), again(t_ids).logits)
    assert hf.config_from_hf(again.config.to_dict()) == cfg


def _hf(model_type, **over):
    """A config.json dict of `model_type` as the hub's checkpoints write it (4 layers)."""
    c = dict(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=48,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=100.0)
    c.update(over)
    return c


def test_hub_style_configs_map_as_transformers_reads_them():
    # Qwen2.5: a window given but off (use_sliding_window=false) -> every layer global
    cfg = hf.config_from_hf(_hf("qwen2", sliding_window=32, max_window_layers=2,
                                use_sliding_window=False))
    assert cfg.layer_pattern == ("global",)
    assert (cfg.attention.qkv_bias, cfg.attention.out_bias) == (True, False)
    # on: layers >= max_window_layers slide; HF's window of 8 counts the query itself
    cfg = hf.config_from_hf(_hf("qwen2", sliding_window=8, max_window_layers=2,
                                use_sliding_window=True))
    assert cfg.layer_pattern == ("global", "global", "local", "local")
    assert cfg.attention.sliding_window == 7
    # SmolLM3: an explicit per-layer list (1: RoPE, 0: NoPE), or every interval-th NoPE
    cfg = hf.config_from_hf(_hf("smollm3", no_rope_layers=[1, 0, 0, 1]))
    assert [cfg.layer_kind(i) for i in range(4)] == ["global", "nope", "nope", "global"]
    cfg = hf.config_from_hf(_hf("smollm3", no_rope_layer_interval=3))
    assert [cfg.layer_kind(i) for i in range(4)] == ["global", "global", "nope", "global"]
    # Gemma 3 as transformers 4.x wrote it: rope_theta + rope_scaling for the global
    # layers, rope_local_base_freq for the sliding ones, the 5:1 default pattern
    cfg = hf.config_from_hf(_hf("gemma3_text", num_hidden_layers=7, head_dim=8,
                                sliding_window=16, rope_theta=1e6, rope_local_base_freq=1e4,
                                rope_scaling=dict(rope_type="linear", factor=8.0)))
    assert cfg.layer_pattern == ("local",) * 5 + ("global",) and cfg.attention.sliding_window == 15
    assert (cfg.rope.theta, cfg.rope.scaling, cfg.rope.factor) == (1e6, "linear", 8.0)
    assert cfg.attention.local_rope_theta == 1e4 and cfg.attention.softcap == 0.0
    # Qwen3-MoE as the hub writes it (num_experts, not transformers 5's num_local_experts)
    cfg = hf.config_from_hf(_hf("qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=16, decoder_sparse_step=2,
                                mlp_only_layers=[3], norm_topk_prob=False))
    assert [cfg.ffn_kind(i) for i in range(4)] == ["dense", "moe", "dense", "dense"]
    assert (cfg.moe.num_experts, cfg.moe.d_ff, cfg.moe.router_renormalize) == (8, 16, False)


@pytest.mark.parametrize("model_type, over, match", [
    ("phi3", dict(rope_parameters=dict(rope_type="longrope", short_factor=[1.0] * 4,
                                       long_factor=[2.0] * 4, rope_theta=100.0,
                                       original_max_position_embeddings=16,
                                       attention_factor=1.5)),
     "rope_parameters.attention_factor=1.5"),
    ("phi3", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=100.0)),
     "rope_parameters.rope_type='dynamic'"),
    ("smollm3", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": dict(rope_type="default", rope_theta=1e6),
        "sliding_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e4)}),
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=8),
     "layer_types"),
])
def test_unsupported_options_are_refused_by_name(model_type, over, match):
    with pytest.raises(NotImplementedError, match=match.replace("[", r"\[")):
        hf.config_from_hf(_hf(model_type, **over))


@pytest.mark.parametrize("model_type, over, match", [
    ("qwen3_moe", dict(num_experts=8, num_local_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16), "num_experts and num_local_experts disagree"),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       mlp_only_layers="0"), "mlp_only_layers"),
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers must be a list of"),
    ("phi3", dict(original_max_position_embeddings=16, rope_parameters=dict(
        rope_type="longrope", rope_theta=100.0, short_factor=[1.0] * 3, long_factor=[2.0] * 4)),
     "model.rope.short_factor: longrope needs rotary dims / 2 = 4 positive factors, got 3"),
])
def test_bad_values_name_the_key(model_type, over, match):
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(_hf(model_type, **over))


def test_longrope_frequencies_match_transformers():
    """A `RopeConfig(scaling="longrope")` RoPE against transformers' own LongRoPE init,
    within and past original_max_position_embeddings, with its attention factor."""
    short, long = [1.0, 1.5, 2.0, 3.0], [1.5, 3.0, 6.0, 12.0]
    config = transformers.Phi3Config(**BASE, original_max_position_embeddings=16,
                                     rope_parameters=dict(rope_type="longrope", rope_theta=100.0,
                                                          short_factor=short, long_factor=long))
    rope = RotaryEmbedding(8, RopeConfig(theta=100.0, scaling="longrope", factor=4.0,
                                         original_max_len=16, short_factor=tuple(short),
                                         long_factor=tuple(long)))
    for seq_len in (10, 16, 17, 40):
        theirs, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        np.testing.assert_allclose(np.asarray(rope.inv_freq(seq_len)), theirs.numpy(), rtol=1e-6)
        assert abs(rope.attention_factor - factor) < 1e-12


def test_qwen3_moe_fused_expert_tensors_load_as_the_per_expert_ones(tmp_path):
    """transformers 5's fused expert layout (`mlp.experts.gate_up_proj [E, 2F, D]`, rows
    gate then up, and `down_proj [E, D, F]`) gives the same model as the per-expert
    tensors save_pretrained writes."""
    ref = _save("qwen3_moe", tmp_path)
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    fused = {}
    for name in ckpt:
        if ".mlp.experts." not in name:
            fused[name] = np.asarray(ckpt[name])
    E = ref.config.num_experts
    for i in (1, 2):  # the routed layers
        p = f"model.layers.{i}.mlp.experts."
        get = lambda e, n: np.asarray(ckpt[f"{p}{e}.{n}.weight"])  # noqa: E731
        fused[p + "gate_up_proj"] = np.stack(
            [np.concatenate([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(E)])
        fused[p + "down_proj"] = np.stack([get(e, "down_proj") for e in range(E)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file(fused, str(out / "model.safetensors"))
    (out / "config.json").write_text((tmp_path / "config.json").read_text())
    model, _ = hf.load(str(out))
    ids = np.random.default_rng(0).integers(3, V, size=(2, 10))
    with torch.no_grad():
        assert_logits_close(model(jnp.asarray(ids)), ref(torch.tensor(ids)).logits)


def test_a_bare_base_model_checkpoint_loads(tmp_path):
    """A `Qwen2Model` checkpoint (no `model.` prefix, no head; tied embeddings) loads:
    tfjax's logits are its last hidden state times the embedding."""
    config = CASES["qwen2"][0]()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    ref = transformers.Qwen2Model._from_config(config, attn_implementation="eager").eval()
    ref.save_pretrained(tmp_path)
    model, _ = hf.load(str(tmp_path))
    ids = np.random.default_rng(0).integers(3, V, size=(2, 10))
    with torch.no_grad():
        hidden = ref(torch.tensor(ids)).last_hidden_state
        assert_logits_close(model(jnp.asarray(ids)), hidden @ ref.embed_tokens.weight.T)


def test_longrope_generation_across_the_switch_matches_transformers(tmp_path):
    """A 5-token prompt generating 12 tokens crosses original_max_position_embeddings=8:
    HF drops its cache there and re-encodes with the long factors; ours rebuilds its
    cache at the same step (`generate` and `stream` alike), so all tokens agree."""
    ref = _save("phi3_longrope", tmp_path)
    model, _ = hf.load(str(tmp_path))
    rng = np.random.default_rng(1)
    for ids in (rng.integers(3, V, size=(8, 5)), rng.integers(3, V, size=(8, 3))):
        assert_greedy_equal(model, ref, ids, new_tokens=12)
    streamed = np.stack(list(stream(model, jnp.asarray(ids), max_new_tokens=12)), axis=1)
    np.testing.assert_array_equal(streamed, np.asarray(generate(model, jnp.asarray(ids),
                                                                max_new_tokens=12)))
    with pytest.raises(ValueError, match="prefill_chunk=4: a LongRoPE prompt of 10 tokens"):
        generate(model, jnp.zeros((1, 10), jnp.int32), max_new_tokens=2, prefill_chunk=4)
