"""Hook values against transformers: for random tiny checkpoints of several families
(saved with `save_pretrained`, loaded by `tfjax.interop.hf.load`, scanned) each
layer's `hook_resid_pre` (and the last one's output, normed) equal `output_hidden_states`,
`hook_pattern` equals `output_attentions` (eager attention), and a head ablated at
`hook_z` gives the logits of the HF model with that head's output columns zeroed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.interop import hf  # noqa: E402
from tfjax.interp import run_with_cache, run_with_hooks  # noqa: E402

V, L = 96, 3
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=L,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             initializer_range=0.1, tie_word_embeddings=False)
# name -> (HF config, HF class, the attention's output projection of layer l)
CASES = {
    "llama": (lambda: transformers.LlamaConfig(**LLAMA), "LlamaForCausalLM",
              lambda m, l: m.model.layers[l].self_attn.o_proj.weight),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=L, n_head=4,
                                             n_positions=64, initializer_range=0.1),
             "GPT2LMHeadModel", None),
    # soft-capped logits, sliding windows on alternate layers, GQA
    "gemma2": (lambda: transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16,
        sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        initializer_range=0.1), "Gemma2ForCausalLM",
        lambda m, l: m.model.layers[l].self_attn.o_proj.weight),
    "qwen2": (lambda: transformers.Qwen2Config(**LLAMA), "Qwen2ForCausalLM",  # q/k/v biases
              lambda m, l: m.model.layers[l].self_attn.o_proj.weight),
}


@pytest.fixture(autouse=True, scope="module")
def _torch_on_one_thread(one_torch_thread):
    pass


def _pair(name, path):
    make, cls, _ = CASES[name]
    torch.manual_seed(0)
    ref = getattr(transformers, cls)._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 1:  # biases and norm weights off their init, so a swap shows
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(path)
    model, _ = hf.load(path)
    return ref, model


def _ids():
    return np.random.default_rng(0).integers(3, V, size=(2, 10))


@pytest.mark.parametrize("name", list(CASES))
def test_hidden_states_and_patterns_equal_transformers(name, tmp_path):
    ref, model = _pair(name, str(tmp_path))
    ids = _ids()
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_hidden_states=True, output_attentions=True)
    logits, cache = run_with_cache(model, jnp.asarray(ids), names=lambda n: (
        n.endswith(("hook_resid_pre", "hook_pattern")) or n == f"blocks.{L - 1}.hook_resid_post"))
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=1e-4)
    hidden, attentions = out.hidden_states, out.attentions  # L + 1 (the last normed), L
    assert len(hidden) == L + 1 and len(attentions) == L
    for l in range(L):
        np.testing.assert_allclose(cache[f"blocks.{l}.hook_resid_pre"], hidden[l].numpy(),
                                   atol=1e-4, err_msg=f"{name} layer {l}")
        np.testing.assert_allclose(cache[f"blocks.{l}.attn.hook_pattern"],
                                   attentions[l].numpy(), atol=1e-5,
                                   err_msg=f"{name} pattern {l}")
    # HF's last hidden state is after the final norm (with its scale: hook_normalized,
    # as TransformerLens's, is before it)
    np.testing.assert_allclose(model.final_norm(cache[f"blocks.{L - 1}.hook_resid_post"]),
                               hidden[L].numpy(), atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_head_ablated_at_hook_z_equals_transformers_with_its_columns_zeroed(name, tmp_path):
    ref, model = _pair(name, str(tmp_path))
    ids, layer, head, H = _ids(), 1, 3, 8
    ours = run_with_hooks(model, jnp.asarray(ids), fwd_hooks=[(
        f"blocks.{layer}.attn.hook_z", lambda z, hook: z.at[:, :, head].set(0.0))])
    o = CASES[name][2](ref, layer)
    kept = o.detach().clone()
    try:
        with torch.no_grad():
            o[:, head * H:(head + 1) * H] = 0.0
            theirs = ref(torch.tensor(ids)).logits.numpy()
    finally:
        with torch.no_grad():
            o.copy_(kept)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert np.abs(np.asarray(ours) - ref(torch.tensor(ids)).logits.detach().numpy()).max() > 1e-3
