"""Parity of `tfjax.interop.hf.load` with transformers: for each family a random tiny HF
model is saved with `save_pretrained`, loaded by tfjax, and compared on fp32 logits
(max |ours - theirs| <= 1e-4 * max |theirs|) and, for causal LMs, on 20 greedy tokens
of `tfjax.inference.generate` vs HF `generate`."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from hf_parity import assert_greedy_equal, assert_logits_close  # noqa: E402
from tfjax.interop import hf  # noqa: E402

V = 96
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.1, tie_word_embeddings=False)


def _llama(**rope):
    return transformers.LlamaConfig(**LLAMA, rope_parameters=dict(rope_theta=100.0, **rope))


# name -> (HF config factory, HF model class name, kind); kind "lm" checks logits and 20
# greedy tokens, "logits" only logits (rope scalings whose cache path is llama_linear's).
CASES = {
    "llama_linear": (lambda: _llama(rope_type="linear", factor=2.0), "LlamaForCausalLM", "lm"),
    "llama_llama3": (lambda: _llama(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=16),
                     "LlamaForCausalLM", "logits"),
    "llama_yarn": (lambda: _llama(rope_type="yarn", factor=4.0, attention_factor=1.3, beta_fast=8.0,
                                  original_max_position_embeddings=16), "LlamaForCausalLM",
                   "logits"),
    # max_position_embeddings < the 10 prompt tokens: the base grows (HF and ours alike)
    "llama_dynamic": (lambda: transformers.LlamaConfig(**dict(
        LLAMA, max_position_embeddings=8), rope_parameters=dict(
        rope_theta=100.0, rope_type="dynamic", factor=2.0)), "LlamaForCausalLM", "logits"),
    "mistral": (lambda: transformers.MistralConfig(**LLAMA, sliding_window=5), "MistralForCausalLM",
                "lm"),
    "qwen3": (lambda: transformers.Qwen3Config(**dict(LLAMA, tie_word_embeddings=True),
                                               head_dim=16, attention_bias=True),
              "Qwen3ForCausalLM", "lm"),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                             n_positions=64, initializer_range=0.1),
             "GPT2LMHeadModel", "lm"),
    "neox": (lambda: transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, initializer_range=0.1,
        rope_parameters=dict(rope_theta=100.0, rope_type="default", partial_rotary_factor=0.5)),
        "GPTNeoXForCausalLM", "lm"),
    "gemma2": (lambda: transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16,
        sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        initializer_range=0.1), "Gemma2ForCausalLM", "lm"),
    "mixtral": (lambda: transformers.MixtralConfig(**LLAMA, num_local_experts=4,
                                                   num_experts_per_tok=2),
                "MixtralForCausalLM", "lm"),
    "bloom": (lambda: transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                               initializer_range=0.1), "BloomForCausalLM", "lm"),
    "mamba": (lambda: transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                               state_size=8, initializer_range=0.1),
              "MambaForCausalLM", "lm"),
    "bert": (lambda: transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=48,
                                             max_position_embeddings=32, initializer_range=0.1),
             "BertForPreTraining", "bert"),
    "t5": (lambda: transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                         num_decoder_layers=3, num_heads=4,
                                         relative_attention_num_buckets=8,
                                         relative_attention_max_distance=16), 
           "T5ForConditionalGeneration", "t5"),
}


def _save(name, path):
    make, cls, kind = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if kind == "t5":  # T5's init is tiny; widen it so the test sees real attention
                p.normal_(0.0, 0.3)
            elif p.ndim == 1:  # biases start at 0 and norm weights at 1: a swapped or
                p.add_(0.1 * torch.randn_like(p))  # dropped one would go unnoticed
    model.save_pretrained(path)
    return model, kind


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name, tmp_path):
    ref, kind = _save(name, tmp_path)
    model, cfg = hf.load(str(tmp_path))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, V, size=(2, 10))
    t_ids = torch.tensor(ids)
    with torch.no_grad():
        if kind == "bert":
            types = (np.arange(10)[None] >= 6).astype(np.int64).repeat(2, 0)
            mask = np.ones_like(ids)
            mask[1, 7:] = 0  # row 1: 7 real tokens, then padding (compared where real)
            out = ref(t_ids, token_type_ids=torch.tensor(types), attention_mask=torch.tensor(mask))
            ours = model(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
            assert_logits_close(np.asarray(ours)[mask == 1], out.prediction_logits[torch.tensor(mask) == 1])
            pooled = ref.bert(t_ids, token_type_ids=torch.tensor(types)).pooler_output
            assert_logits_close(model.pooled_output(jnp.asarray(ids), jnp.asarray(types)), pooled)
            return
        if kind == "t5":
            dec = rng.integers(0, V, size=(2, 7))
            theirs = ref(input_ids=t_ids, decoder_input_ids=torch.tensor(dec)).logits
            assert_logits_close(model(jnp.asarray(ids), jnp.asarray(dec)), theirs)
            return
        assert_logits_close(model(jnp.asarray(ids)), ref(t_ids).logits)
        if kind != "lm":
            return
    assert_greedy_equal(model, ref, ids)
