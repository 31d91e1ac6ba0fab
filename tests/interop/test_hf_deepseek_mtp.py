"""DeepSeek-V3's multi-token-prediction layer loads into `model.mtp`: a tiny random
transformers DeepSeek-V3 is saved, and an MTP layer as the hub's checkpoints hold it
(`model.layers.{n}`: enorm, hnorm, eh_proj, shared_head.norm, a decoder layer of
transformers' own `DeepseekV3DecoderLayer`, and copies of the embedding and head) is
added. Its depth-1 logits are computed by hand from those modules, as DeepSeek-V3
section 2.2 writes them: head(norm(layer(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]))))
with h the main model's last layer output before its norm; tfjax's must agree within
1e-4, and self-speculative decoding must give the plain greedy tokens."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402

from hf_parity import assert_logits_close  # noqa: E402
from test_hf_moe import _save  # noqa: E402
from tfjax.inference import generate, speculative_generate  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.models.mtp import mtp_predictions  # noqa: E402


def _add_mtp_layer(ref, path):
    """Write an MTP layer after `ref`'s layers into its checkpoint; returns its modules."""
    config = ref.config
    n, D = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(1)
    mods = torch.nn.ModuleDict(dict(
        layer=ds.DeepseekV3DecoderLayer(config, layer_idx=n),
        enorm=ds.DeepseekV3RMSNorm(D, config.rms_norm_eps),
        hnorm=ds.DeepseekV3RMSNorm(D, config.rms_norm_eps),
        eh_proj=torch.nn.Linear(2 * D, D, bias=False),
        norm=ds.DeepseekV3RMSNorm(D, config.rms_norm_eps))).eval()
    with torch.no_grad():
        for name, p in mods.named_parameters():
            if p.ndim == 1:  # norms start at 1: a swapped one would go unnoticed
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        mods.layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    tensors = load_file(str(path / "model.safetensors"))
    p = f"model.layers.{n}."
    # The layer's tensors as the hub names them (per-expert), by transformers' own save
    # of a model one layer deeper whose last layer is this one.
    deeper = type(ref)._from_config(type(config)(**{**config.to_dict(),
                                                    "num_hidden_layers": n + 1}))
    deeper.model.layers[n].load_state_dict(mods.layer.state_dict())
    deeper.save_pretrained(path / "deeper")
    saved = load_file(str(path / "deeper" / "model.safetensors"))
    tensors.update({k: v for k, v in saved.items() if k.startswith(p)})
    for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                         ("norm", "shared_head.norm")):
        tensors[p + theirs + ".weight"] = mods[ours].weight.detach().contiguous()
    tensors[p + "embed_tokens.weight"] = ref.model.embed_tokens.weight.detach().clone()
    tensors[p + "shared_head.head.weight"] = ref.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return mods


def _reference_mtp_logits(ref, mods, ids):
    """Depth-1 logits `[B, T-1, V]` at positions 0..T-2 (predicting tokens 2..T)."""
    seen = {}
    hook = ref.model.layers[-1].register_forward_hook(lambda m, i, o: seen.update(
        h=o[0] if isinstance(o, tuple) else o))
    t = torch.tensor(ids)
    ref(t)
    hook.remove()
    T = ids.shape[1] - 1
    x = mods.eh_proj(torch.cat([mods.enorm(ref.model.embed_tokens(t[:, 1:])),
                                mods.hnorm(seen["h"][:, :-1])], dim=-1))
    pos = torch.arange(T)[None].expand(ids.shape[0], T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    y = mods.layer(x, attention_mask=mask, position_ids=pos,
                   position_embeddings=ref.model.rotary_emb(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    return ref.lm_head(mods.norm(y))


def test_deepseek_mtp_layer_loads_into_model_mtp(tmp_path):
    ref = _save("deepseek_v3", tmp_path)
    mods = _add_mtp_layer(ref, tmp_path)
    model, cfg = hf.load(str(tmp_path))
    assert cfg.mtp_depth == 1
    ids = np.random.default_rng(0).integers(3, ref.config.vocab_size, size=(2, 10))
    with torch.no_grad():
        theirs = _reference_mtp_logits(ref, mods, ids)
        assert_logits_close(model(jnp.asarray(ids)), ref(torch.tensor(ids)).logits)
    x = jnp.asarray(ids)
    batch = dict(inputs=x, targets=x, mask=jnp.ones(x.shape, jnp.float32))
    (depth1,) = mtp_predictions(model, model.hidden(x), batch)
    assert_logits_close(model.head(depth1["features"])[:, :-1], theirs)
    # the modules draft for self-speculative decoding; greedy tokens are unchanged
    out, _ = speculative_generate(model, x, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(generate(model, x,
                                                                       max_new_tokens=12)))
    with pytest.raises(ValueError, match="mtp_depth"):  # transformers has no MTP to export
        hf.export(model, str(tmp_path / "export"))


def test_a_checkpoint_without_its_mtp_layer_loads_without_mtp(tmp_path):
    """transformers' own saves drop the MTP layer even when the config counts one."""
    _save("deepseek_v3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hf.load(str(tmp_path))[1].mtp_depth == 0
