"""Parity of `tfjax.interop.hf.load` with transformers' `Zamba2ForCausalLM`
(`tfjax.interop.families.zamba2`): a random tiny HF model (torch paths, no CUDA
kernels) is saved with `save_pretrained` (each shared block once, with its uses'
adapters), loaded by tfjax and compared on fp32 logits (max |ours - theirs| <= 1e-4 *
max |theirs|) and on 20 greedy tokens of `tfjax.inference.generate` against HF
`generate`."""

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
# Two shared blocks used in turn by three hybrid layers (blocks 0, 1, 0), MHA of 2
# heads of 2D/2 = 32 over the 2D-wide input, rank-4 adapters on q, k, v and the MLP's
# gate_up, RoPE, Mamba-2 layers of 4 heads, a chunk shorter than the prompt.
ZAMBA2 = dict(vocab_size=V, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
              num_key_value_heads=2, intermediate_size=48, mamba_d_state=8, mamba_d_conv=3,
              n_mamba_heads=4, mamba_ngroups=2, chunk_size=4, num_mem_blocks=2,
              use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
              initializer_range=0.2, tie_word_embeddings=False, time_step_min=1e-4)

CASES = {
    "rope_adapters": ZAMBA2,
    # one block, no attention adapters, no RoPE, tied head, irregular hybrid layers
    "plain": dict(ZAMBA2, num_mem_blocks=1, use_shared_attention_adapter=False,
                  use_mem_rope=False, tie_word_embeddings=True,
                  layers_block_type=["hybrid", "mamba", "mamba", "hybrid", "hybrid", "mamba"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity(name, tmp_path):
    torch.manual_seed(0)
    ref = transformers.Zamba2ForCausalLM._from_config(
        transformers.Zamba2Config(**CASES[name]), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 1:  # norm weights start at 1: a swapped one would go unnoticed
                p.add_(0.1 * torch.randn_like(p))
        _tie(ref)
    ref.save_pretrained(tmp_path)
    model, cfg = hf.load(str(tmp_path))
    assert cfg.shared.num_blocks == CASES[name]["num_mem_blocks"]
    ids = np.random.default_rng(0).integers(3, V, size=(2, 10))
    with torch.no_grad():
        assert_logits_close(model(jnp.asarray(ids)), ref(torch.tensor(ids)).logits)
    assert_greedy_equal(model, ref, ids)


def _tie(ref):
    """Apply the tie transformers records but does not apply (5.24): hybrid layer u's
    block := the block of hybrid layer u % num_mem_blocks (`tfjax.interop.families.zamba2`
    explains)."""
    c, layers = ref.config, ref.model.layers
    for u, i in enumerate(c.hybrid_layer_ids):
        first = c.hybrid_layer_ids[u % c.num_mem_blocks]
        if first != i:
            layers[i].shared_transformer.load_state_dict(
                layers[first].shared_transformer.state_dict())


def test_untied_copies_are_refused(tmp_path):
    """A checkpoint whose later hybrid layer holds a block that differs from the one it
    ties to cannot be one tfjax model: refused naming the tensor."""
    torch.manual_seed(0)
    ref = transformers.Zamba2ForCausalLM._from_config(transformers.Zamba2Config(**ZAMBA2))
    ref.save_pretrained(tmp_path)  # untied: layer 5's block is its own
    with pytest.raises(ValueError, match="model.layers.5.shared_transformer"):
        hf.load(str(tmp_path))


def test_long_context_is_refused_by_name():
    cfg = transformers.Zamba2Config(**dict(ZAMBA2, use_long_context=True))
    with pytest.raises(NotImplementedError, match="use_long_context"):
        hf.config_from_hf(cfg.to_dict())
