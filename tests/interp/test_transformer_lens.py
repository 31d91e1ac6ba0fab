"""tfjax.interp against TransformerLens (its `TransformerBridge` over the HF model, raw
weights): a random tiny GPT-2 saved once, loaded by tfjax (scanned) and wrapped by
TransformerLens; every hook value both have equal, and the same patches (a head
ablated at `hook_z`, a clean residual patched into a corrupted run) give the same
logits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")
pytest.importorskip("transformer_lens", reason="the interp extra (transformer-lens) is not "
                    "installed")

import jax.numpy as jnp  # noqa: E402
import tokenizers  # noqa: E402
from transformer_lens import patching  # noqa: E402
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

from tfjax.interop import hf  # noqa: E402
from tfjax.interp import patching_sweep, run_with_cache, run_with_hooks  # noqa: E402

V, L, N, T = 96, 3, 4, 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_torch_thread):
    """(tfjax model, TransformerLens bridge) of the same random GPT-2 weights."""
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel._from_config(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=L, n_head=N, n_positions=64, initializer_range=0.1),
        attn_implementation="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 1:  # biases and norm weights off their init
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gpt2")
    ref.save_pretrained(path / "model")  # before the bridge rewires the HF modules
    model, _ = hf.load(str(path / "model"))
    # the bridge wants a tokenizer it can reload by path (no hub): a word-level one
    vocab = {f"t{i}": i for i in range(V)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")),
        unk_token="t0", bos_token="t1", eos_token="t2")
    tok.save_pretrained(path / "tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(path / "tokenizer")
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=ref, tokenizer=tok)
    return model, bridge


def _ids(seed):
    return np.random.default_rng(seed).integers(3, V, size=(2, T))


def test_every_shared_hook_value_equals_transformer_lens(pair):
    model, bridge = pair
    ids = _ids(0)
    logits, cache = run_with_cache(model, jnp.asarray(ids))
    with torch.no_grad():
        theirs_logits, theirs = bridge.run_with_cache(torch.tensor(ids))
    np.testing.assert_allclose(logits, theirs_logits.numpy(), atol=1e-4)
    shared = [k for k in cache if k in theirs.keys()]
    assert len(shared) == len(cache) == 3 + 15 * L  # every tfjax name has its TL twin
    causal = np.tril(np.ones((T, T), bool))
    for name in shared:
        ours, want = np.asarray(cache[name]), theirs[name].numpy()
        assert ours.shape == want.shape, name
        if name.endswith("hook_attn_scores"):  # masked: -inf here, a large negative there
            assert np.all(np.isneginf(ours[..., ~causal]))
            ours, want = ours[..., causal], want[..., causal]
        np.testing.assert_allclose(ours, want, atol=1e-5, err_msg=name)


def test_patches_give_transformer_lens_s_logits(pair):
    """A head zero-ablated at hook_z, and the clean run's residual at one layer and
    position patched into a corrupted run (activation patching)."""
    model, bridge = pair
    clean, corrupted = _ids(0), _ids(1)
    layer, head, pos = 1, 2, 4

    def ablate_ours(z, hook):
        return z.at[:, :, head].set(0.0)

    def ablate_theirs(z, hook):
        z[:, :, head] = 0.0
        return z

    ours = run_with_hooks(model, jnp.asarray(clean),
                          fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate_ours)])
    with torch.no_grad():
        theirs = bridge.run_with_hooks(torch.tensor(clean), fwd_hooks=[
            (f"blocks.{layer}.attn.hook_z", ablate_theirs)])
    assert np.ptp(theirs.numpy()) > 1e-3  # the cells differ: a grid worth comparing
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4)

    name = f"blocks.{layer}.hook_resid_pre"
    _, kept = run_with_cache(model, jnp.asarray(clean), names=[name])
    resid = kept[name][:, pos]
    ours = run_with_hooks(model, jnp.asarray(corrupted),
                          fwd_hooks=[(name, lambda x, hook: x.at[:, pos].set(resid))])
    resid_t = torch.tensor(np.asarray(resid))

    def patch_theirs(x, hook):
        x[:, pos] = resid_t
        return x

    with torch.no_grad():
        theirs = bridge.run_with_hooks(torch.tensor(corrupted), fwd_hooks=[(name, patch_theirs)])
    assert np.ptp(theirs.numpy()) > 1e-3  # the cells differ: a grid worth comparing
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4)
    plain = run_with_hooks(model, jnp.asarray(corrupted))
    assert np.abs(np.asarray(ours) - np.asarray(plain))[:, pos:].max() > 1e-3  # it moved
    np.testing.assert_allclose(np.asarray(ours)[:, :pos], np.asarray(plain)[:, :pos], atol=1e-5)


def test_patching_sweep_equals_transformer_lens_s(pair):
    """`patching_sweep(..., "resid_pre")` against TransformerLens's own sweep
    (`transformer_lens.patching.get_act_patch_resid_pre`): the same [L, T] grid."""
    model, bridge = pair
    clean, corrupted = _ids(0), _ids(1)
    answer, wrong = 5, 9

    def metric(logits):  # jax or torch logits [B, T, V]
        return (logits[:, -1, answer] - logits[:, -1, wrong]).mean()

    ours = patching_sweep(model, jnp.asarray(clean), jnp.asarray(corrupted), metric, "resid_pre")
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(torch.tensor(clean))
        theirs = patching.get_act_patch_resid_pre(bridge, torch.tensor(corrupted), clean_cache,
                                                  metric)
    assert ours.shape == tuple(theirs.shape) == (L, T)
    assert np.ptp(theirs.numpy()) > 1e-3  # the cells differ: a grid worth comparing
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4)
