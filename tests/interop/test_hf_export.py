"""`tfjax.interop.hf.export` for every family `load` reads: a random tiny HF model of
each (the parity cases of test_hf.py plus options of their own here) is loaded, exported
and read back by transformers (`from_pretrained`: the same fp32 logits as the model
saved, within 1e-4 of max |logits|) and by `load` (every parameter bit for bit, the
same tensor names as transformers' own `save_pretrained`); native tfjax models are
exported under the family that holds them, or refused naming the fields; the inverse
of a weights mapping refuses what is not element movement and what it does not cover
exactly once."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hf import CASES, V, _save

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.config import model_config  # noqa: E402
from hf_parity import assert_logits_close  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.computation import computation  # noqa: E402
from tfjax.interop.hf_invert import Inverse  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint  # noqa: E402
from tfjax.models import build  # noqa: E402

# Options test_hf.py's cases leave at their defaults, in the same form (name -> (HF
# config factory, class, kind)).
EXTRA = {
    "gpt2_untied_relu": (lambda: transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=40, n_inner=40,
        activation_function="relu", tie_word_embeddings=False, scale_attn_weights=False,
        initializer_range=0.1), "GPT2LMHeadModel", "lm"),
    "neox_sequential": (lambda: transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, use_parallel_residual=False, attention_bias=False,
        tie_word_embeddings=True, initializer_range=0.1,
        rope_parameters=dict(rope_theta=50.0, rope_type="linear", factor=2.0,
                             partial_rotary_factor=0.25)), "GPTNeoXForCausalLM", "lm"),
    "qwen3_windows": (lambda: transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_sliding_window=True, tie_word_embeddings=False, initializer_range=0.1),
        "Qwen3ForCausalLM", "lm"),
    "mixtral_windowed": (lambda: transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, num_local_experts=3,
        num_experts_per_tok=1, sliding_window=5, tie_word_embeddings=True,
        initializer_range=0.1), "MixtralForCausalLM", "lm"),
    "bloom_untied": (lambda: transformers.BloomConfig(
        vocab_size=V, hidden_size=32, n_layer=2, n_head=2, tie_word_embeddings=False,
        initializer_range=0.1), "BloomForCausalLM", "lm"),
    "mamba_biased": (lambda: transformers.MambaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=48, num_hidden_layers=2, state_size=4,
        conv_kernel=3, time_step_rank=3, use_bias=True, use_conv_bias=False,
        tie_word_embeddings=False, initializer_range=0.1), "MambaForCausalLM", "lm"),
    "bert_mlm": (lambda: transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=40, max_position_embeddings=24, type_vocab_size=3,
        layer_norm_eps=1e-6, initializer_range=0.1), "BertForMaskedLM", "bert"),
    "t5_gated": (lambda: transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=4, d_ff=40, num_layers=3, num_decoder_layers=2,
        num_heads=2, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        relative_attention_num_buckets=6, relative_attention_max_distance=12),
        "T5ForConditionalGeneration", "t5"),
}
ALL = {**CASES, **EXTRA}


def _params(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _logits(model, kind, ids):
    with torch.no_grad():
        if kind == "t5":
            return model(input_ids=ids, decoder_input_ids=ids[:, :7]).logits
        if kind == "bert":
            out = model(ids, token_type_ids=ids % 2)
            return out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
        return model(ids).logits


def _make(name, path):
    if name in CASES:
        return _save(name, path)
    make, cls, kind = EXTRA[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if kind == "t5":
                p.normal_(0.0, 0.3)
            elif p.ndim == 1:  # a swapped bias or norm weight shows
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model, kind


@pytest.mark.parametrize("name", list(ALL))
def test_export_round_trip(name, tmp_path):
    ref, kind = _make(name, tmp_path / "hf")
    model, cfg = hf.load(str(tmp_path / "hf"))
    hf.export(model, str(tmp_path / "out"))

    theirs = SafetensorsCheckpoint(str(tmp_path / "hf"))
    ours = SafetensorsCheckpoint(str(tmp_path / "out"))
    nsp = {"cls.seq_relationship.weight", "cls.seq_relationship.bias"}  # tfjax has no NSP head
    assert set(ours) == set(theirs) - nsp

    back = type(ref).from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    ids = torch.tensor(np.random.default_rng(0).integers(3, V, size=(2, 10)))
    assert_logits_close(_logits(back, kind, ids).numpy(), _logits(ref, kind, ids))

    again, cfg2 = hf.load(str(tmp_path / "out"))
    assert computation(cfg2) == computation(cfg)
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


LLAMA = dict(arch="decoder", vocab_size=80, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
             d_ff=40, activation="swiglu", norm="rmsnorm", norm_eps=1e-6, ffn_bias=False,
             tie_embeddings=False, position="rope", init_std=0.1, max_len=64)


def test_native_model_exports_under_the_family_that_holds_it(tmp_path):
    """A tfjax model with alternating windows and QK-norm is a Qwen3 (Llama has neither):
    export finds the family itself, and transformers computes what tfjax does."""
    cfg = model_config(dict(LLAMA, layer_pattern=("local", "global"), head_dim=16, num_layers=4,
                            attention=dict(qk_norm=True, sliding_window=3, qkv_bias=True,
                                           out_bias=True),
                            rope=dict(theta=100.0, scaling="yarn", factor=2.0,
                                      original_max_len=32)))
    model = build(cfg, rngs=nnx.Rngs(2))
    hf.export(model, str(tmp_path), dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(ref).__name__ == "Qwen3ForCausalLM"
    ids = np.random.default_rng(1).integers(0, 80, size=(2, 12))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits
    assert_logits_close(model(jnp.asarray(ids)), theirs)


def _abstract(fields):  # a model with no values: what refusals read is its config
    return nnx.eval_shape(lambda: build(model_config(fields), rngs=nnx.Rngs(0)))


@pytest.mark.bad_input
@pytest.mark.parametrize("change, family, message", [
    # ALiBi is BLOOM's alone, and BLOOM's MLP is GELU
    (dict(position="alibi"), None, r"no Hugging Face family holds this model .*"
     r"model.position='alibi'"),
    (dict(position="alibi"), "bloom", r"model_type 'bloom' cannot hold this model: "
     r"model.activation='swiglu' \(bloom: 'gelu_tanh'\)"),
    (dict(layer_pattern=("global", "local"), attention=dict(sliding_window=4)), "llama",
     r"model.layer_pattern=\('global', 'local', 'global'\) \(llama: \('global', 'global', "
     r"'global'\)\)"),
    (dict(activation="gelu"), "qwen3", r"model.activation='gelu' \(qwen3: 'swiglu'\)"),
    ({}, "nope", r"unknown export family='nope'; allowed: .*llama"),
], ids=["alibi", "alibi_as_bloom", "pattern_as_llama", "gelu_as_qwen3", "unknown_family"])
def test_export_refuses_a_model_its_family_cannot_hold(change, family, message, tmp_path):
    model = _abstract(dict(LLAMA, **change))
    with pytest.raises(ValueError, match=message):
        hf.export(model, str(tmp_path / "out"), family=family)
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.bad_input
def test_export_without_the_hf_extra_says_so(tmp_path, monkeypatch):
    model = _abstract(LLAMA)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError, match=r"export needs the hf extra \(torch, transformers\)"):
        hf.export(model, str(tmp_path / "out"))


# The inverse itself, on symbolic checkpoints of hand-made shapes (no transformers).
CFG = model_config(dict(LLAMA, num_layers=1))


def _inverse(mapping, shapes=None):
    return Inverse(lambda w, cfg, hf_: mapping(w), CFG, {}, shapes or {"a": (4, 6), "b": (6,)},
                   family="toy")


def test_inverse_scatters_back_through_movement():
    inv = _inverse(lambda w: {("x",): w["a"].T.reshape(3, 2, 4)[::-1],
                              ("y",): np.stack(np.split(w["b"], 2)), })
    inv.check()
    a, b = np.arange(24.0).reshape(4, 6), np.arange(6.0) + 100
    ours = {("x",): a.T.reshape(3, 2, 4)[::-1], ("y",): np.stack(np.split(b, 2))}
    np.testing.assert_array_equal(inv.tensor("a", ours.__getitem__, np.float32), a)
    np.testing.assert_array_equal(inv.tensor("b", ours.__getitem__, np.float32), b)


@pytest.mark.bad_input
@pytest.mark.parametrize("mapping, error, message", [
    (lambda w: {("x",): w["a"] * 2, ("y",): w["b"]}, TypeError, "arithmetic on a checkpoint"),
    (lambda w: {("x",): np.float32(2) + w["a"], ("y",): w["b"]}, TypeError, "np.add on a "),
    (lambda w: {("x",): np.exp(w["a"]), ("y",): w["b"]}, TypeError, "not element movement"),
    (lambda w: {("x",): np.asarray(w["a"]), ("y",): w["b"]}, TypeError, "np.asarray"),
    (lambda w: {("x",): w["a"]}, ValueError, r"neither reads nor ignores these tensors of the "
     r"transformers model: b"),
    (lambda w: {("x",): w["a"], ("y",): w["b"], ("z",): np.zeros(3)}, TypeError,
     r"parameter \('z',\) does not come from a checkpoint tensor"),
])
def test_inverse_refuses_what_is_not_element_movement(mapping, error, message):
    with pytest.raises(error, match=message):
        _inverse(mapping)


@pytest.mark.bad_input
@pytest.mark.parametrize("mapping, message", [
    (lambda w: {("x",): w["a"][:3], ("y",): w["b"]}, r"a: .* leaves 6 of its 24 elements "
     r"unwritten and writes 0 more than once"),
    (lambda w: {("x",): w["a"], ("y",): w["b"], ("z",): w["b"][::2]}, r"b: .* leaves 0 of its "
     r"6 elements unwritten and writes 3 more than once"),
])
def test_inverse_covers_every_element_exactly_once(mapping, message):
    with pytest.raises(ValueError, match=message):
        _inverse(mapping).check()
