"""ModernBERT through `tfjax.interop.hf.load` (tfjax.interop.families.modernbert) against
transformers' `ModernBertForMaskedLM` at a random tiny init: fp32 MLM logits within
1e-4 of max |HF logits| on a padded batch whose local window (|q - k| <= 2) is
smaller than the sequence, so local and global layers differ; the options the
mapping refuses; `hf.export` back to transformers."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.config import model_config  # noqa: E402
from hf_parity import assert_logits_close  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.families import modernbert  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint  # noqa: E402
from tfjax.interop.tensor_mapping import Weights  # noqa: E402
from tfjax.models import build  # noqa: E402

V, T = 96, 10
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_attention_heads=4,
            initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2)

CASES = {
    # HF's defaults (no biases, tied decoder with its bias), the old-style keys:
    # layers global, local, global (a scanned cycle of two and an unrolled block)
    "default": dict(num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=4,
                    global_rope_theta=1000.0, local_rope_theta=50.0),
    # every bias flipped, untied, tanh GeGLU; layer_types and rope_parameters given,
    # an odd local_attention (5 // 2 = 2 on each side)
    "options": dict(num_hidden_layers=4, local_attention=5, norm_bias=True, attention_bias=True,
                    mlp_bias=True, classifier_bias=True, decoder_bias=False,
                    tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh",
                    norm_eps=1e-6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "full_attention"],
                    rope_parameters=dict(
                        full_attention=dict(rope_type="default", rope_theta=500.0),
                        sliding_attention=dict(rope_type="default", rope_theta=20.0))),
}


def _save(kw: dict, path):
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**TINY, **kw)
    model = transformers.ModernBertForMaskedLM._from_config(
        config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # biases start at 0 and norm weights at 1: a swapped or
                p.add_(0.1 * torch.randn_like(p))  # dropped one would go unnoticed
    model.save_pretrained(path)
    return model


def _inputs():
    ids = np.random.default_rng(0).integers(3, V, size=(2, T))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # row 1: 7 real tokens, then padding (compared where real)
    return ids, mask


def _mlm(ref, ids, mask):
    with torch.no_grad():
        return ref(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits


@pytest.mark.parametrize("name", list(CASES))
def test_mlm_logits_match_transformers(name, tmp_path):
    ref = _save(CASES[name], tmp_path)
    model, cfg = hf.load(str(tmp_path))
    assert isinstance(model, hf.HFEncoder) and "local" in cfg.layer_pattern
    ids, mask = _inputs()
    ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    theirs = _mlm(ref, ids, mask)
    assert_logits_close(ours[mask == 1], theirs[torch.tensor(mask) == 1])
    # The window matters: all-global layers give other logits.
    assert np.max(np.abs(_mlm(_all_global(ref), ids, mask).numpy() - theirs.numpy())) > 1e-3


def _all_global(ref):
    """`ref` with every layer global (same weights): proof that the window bites."""
    config = ref.config.to_dict()
    config["layer_types"] = ["full_attention"] * ref.config.num_hidden_layers
    model = transformers.ModernBertForMaskedLM._from_config(
        transformers.ModernBertConfig(**config), attn_implementation="eager").eval()
    model.load_state_dict(ref.state_dict())
    return model


def test_unrolled_layers_give_the_scanned_logits(tmp_path):
    """Layer 0 normalising its residual as an unrolled block (a Python layer index)
    and as cycle 0 of the scan (a traced one): the same model."""
    _save(CASES["default"], tmp_path)
    scanned, cfg = hf.load(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
    arrays = modernbert.weights(Weights(SafetensorsCheckpoint(str(tmp_path))), unrolled_cfg,
                                config)
    unrolled = hf.load_state(arrays, unrolled_cfg, allow_missing=(("pooler",),))
    ids, mask = _inputs()
    np.testing.assert_allclose(
        np.asarray(unrolled(jnp.asarray(ids), attention_mask=jnp.asarray(mask))),
        np.asarray(scanned(jnp.asarray(ids), attention_mask=jnp.asarray(mask))),
        rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(name, tmp_path):
    """`hf.export` (the family's `to_hf` and its weights mapping run backwards)
    writes what transformers' `from_pretrained` reads as the same model, and what
    `hf.load` maps back to the same config."""
    ref = _save(CASES[name], tmp_path / "hf")
    model, cfg = hf.load(str(tmp_path / "hf"))
    hf.export(model, str(tmp_path / "out"))
    back = transformers.ModernBertForMaskedLM.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager").eval()
    ids, mask = _inputs()
    real = torch.tensor(mask) == 1
    assert_logits_close(_mlm(back, ids, mask).numpy()[mask == 1], _mlm(ref, ids, mask)[real])
    assert hf.config_from_hf(modernbert.to_hf(cfg)) == cfg
    with pytest.raises(ValueError, match="model.first_norm_residual"):
        modernbert.to_hf(dataclasses.replace(cfg, first_norm_residual=False))


BASE = dict(TINY, model_type="modernbert", num_hidden_layers=2)


@pytest.mark.parametrize("change, error, match", [
    (dict(rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0))),
     NotImplementedError, "rope_parameters.full_attention.rope_type='linear'"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), NotImplementedError,
     "rope_scaling"),
    (dict(classifier_activation="silu"), NotImplementedError, "classifier_activation='silu'"),
    (dict(architectures=["ModernBertForSequenceClassification"]), NotImplementedError,
     "architectures"),
    (dict(architectures=["ModernBertModel"]), NotImplementedError, "architectures"),
    (dict(hidden_activation="tanh"), NotImplementedError, "hidden_activation='tanh'"),
    (dict(layer_types=["full_attention", "chunked_attention"]), NotImplementedError,
     "layer_types='chunked_attention'"),
    (dict(local_attention="128"), ValueError, "local_attention"),
    (dict(layer_types=["full_attention"]), ValueError, "layer_types has 1 entries"),
])
def test_bad_configs_name_the_option(change, error, match):
    with pytest.raises(error, match=match):
        hf.config_from_hf(dict(BASE, **change))


def test_first_norm_residual_needs_a_pre_norm_sequential_attention_block():
    cfg = dict(arch="encoder", vocab_size=V, d_model=16, num_heads=2, d_ff=32,
               first_norm_residual=True)
    with pytest.raises(ValueError, match="model.first_norm_residual"):
        model_config(dict(cfg, norm_placement="post"))
    with pytest.raises(ValueError, match="model.first_norm_residual"):
        build(dict(cfg, arch="decoder", layer_pattern=("mamba",), position="none"))
