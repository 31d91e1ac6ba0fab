"""The two assertions of every checkpoint family's parity test against transformers
(tests/interop/test_hf*.py): fp32 logits within 1e-4 of the largest HF logit, and 20
greedy tokens of `tfjax.inference.generate` (through the KV cache) equal to HF
`generate`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from tfjax.inference import generate


def assert_logits_close(ours, theirs) -> None:
    """`max |ours - theirs| <= 1e-4 * max |theirs|` (theirs: a torch tensor)."""
    ours, theirs = np.asarray(ours), theirs.detach().numpy()
    assert ours.shape == theirs.shape
    err = np.max(np.abs(ours - theirs))
    assert err <= 1e-4 * np.max(np.abs(theirs)), (err, np.max(np.abs(theirs)))


def assert_greedy_equal(model, ref, ids: np.ndarray, new_tokens: int = 20) -> None:
    """tfjax's greedy continuation of `ids` `[B, T]` equals HF `ref.generate`'s (no EOS
    stop on either side)."""
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(torch.tensor(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)
    ours = generate(model, jnp.asarray(ids), max_new_tokens=new_tokens)
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, ids.shape[1]:].numpy())
