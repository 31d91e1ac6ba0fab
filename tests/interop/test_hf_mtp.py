"""DeepSeek-V3's and Qwen3-Next's multi-token-prediction modules load into
`model.mtp`: a tiny random transformers model is saved, and a random layer of
transformers' own `MtpModel` (enorm, hnorm, eh_proj, a decoder layer of the family,
post norm) is added to the checkpoint as the hub's checkpoints hold it (DeepSeek:
`model.layers.{n}`, with copies of the embedding and head; Qwen3-Next: `mtp.fc`,
`mtp.pre_fc_norm_*`, `mtp.layers.0`, `mtp.norm`). tfjax's depth-1 logits must equal `MtpModel`'s draft logits
within 1e-4, fed as transformers' MTP candidate generator feeds it (the main model's
normed last hidden states and the tokens one ahead), and self-speculative decoding
must give the plain greedy tokens."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

from hf_parity import assert_logits_close  # noqa: E402
from test_hf_moe import _save  # noqa: E402
from test_hf_recurrent import _save as _save_recurrent  # noqa: E402
from tfjax.inference import generate, speculative_generate  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.families import qwen3_next  # noqa: E402
from tfjax.models.mtp import mtp_predictions  # noqa: E402


# family -> (the block's hub prefix, hub names of enorm, hnorm, eh_proj and post norm,
# whether the layer holds copies of the embedding and head)
LAYOUT = {
    "deepseek_v3": (None, ("enorm", "hnorm", "eh_proj", "shared_head.norm"), True),
    "qwen3_next": ("mtp.layers.0.", ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden",
                                     "mtp.fc", "mtp.norm"), False),
}


def _add_mtp_layer(ref, path):
    """Write a random MTP layer after `ref`'s layers into its checkpoint, as the hub
    lays it out; returns transformers' `MtpModel` holding the same layer."""
    config = ref.config
    n = config.num_hidden_layers
    block, extras, copies = LAYOUT[config.model_type]
    config.num_mtp_layers = 1
    deeper = {**config.to_dict(), "num_hidden_layers": n + 1}
    if getattr(config, "layer_types", None):  # Qwen3-Next: the MTP layer attends fully
        config.mtp_layer_types = ["full_attention"]
        deeper["layer_types"] = list(config.layer_types) + ["full_attention"]
    mtp = MtpModel(ref, 1).eval()
    layer = mtp.layers[0]
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.ndim == 1:  # norms start at 1 (or 0): a swapped one would go unnoticed
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    tensors = load_file(str(path / "model.safetensors"))
    # The block's tensors as the hub names them (per-expert), by transformers' own save
    # of a model one layer deeper whose last layer is this block.
    deeper = type(ref)._from_config(type(config)(**deeper))
    deeper.model.layers[n].load_state_dict(layer.mtp_block.state_dict())
    deeper.save_pretrained(path / "deeper")
    saved = load_file(str(path / "deeper" / "model.safetensors"))
    p = f"model.layers.{n}."
    block = block or p
    tensors.update({block + k[len(p):]: v for k, v in saved.items() if k.startswith(p)})
    for ours, theirs in zip(("enorm", "hnorm", "eh_proj", "post_norm"), extras):
        name = (theirs if block != p else p + theirs) + ".weight"
        tensors[name] = getattr(layer, ours).weight.detach().contiguous()
    if copies:
        tensors[p + "embed_tokens.weight"] = ref.model.embed_tokens.weight.detach().clone()
        tensors[p + "shared_head.head.weight"] = ref.lm_head.weight.detach().clone()
        cfg = json.loads((path / "config.json").read_text())  # as DeepSeek's configs say
        cfg["num_nextn_predict_layers"] = 1
        (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return mtp


def _reference_mtp_logits(ref, mtp, ids):
    """transformers' depth-1 draft logits `[B, T-1, V]` at positions 0..T-2 (predicting
    tokens 2..T), fed as its MTP candidate generator feeds them: the main model's last
    hidden states (after its final norm) and the tokens one ahead, at their positions."""
    t = torch.tensor(ids)
    last = ref(t, output_hidden_states=True).hidden_states[-1]
    B, T = ids.shape
    pos = torch.arange(1, T)[None].expand(B, T - 1)
    h = mtp.forward_layer(0, last[:, :-1], pos, None, input_ids=t[:, 1:])
    return mtp._project_to_logits(h)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_next_tied"])
def test_mtp_layer_loads_into_model_mtp(name, tmp_path):
    ref = _save(name, tmp_path) if name == "deepseek_v3" else _save_recurrent(name, tmp_path)[0]
    mtp = _add_mtp_layer(ref, tmp_path)
    model, cfg = hf.load(str(tmp_path))
    assert cfg.mtp_depth == 1
    ids = np.random.default_rng(0).integers(3, ref.config.vocab_size, size=(2, 10))
    with torch.no_grad():
        theirs = _reference_mtp_logits(ref, mtp, ids)
        assert_logits_close(model(jnp.asarray(ids)), ref(torch.tensor(ids)).logits)
    x = jnp.asarray(ids)
    batch = dict(inputs=x, targets=x, mask=jnp.ones(x.shape, jnp.float32))
    (depth1,) = mtp_predictions(model, model.hidden(x), batch)
    assert_logits_close(model.head(depth1["features"])[:, :-1], theirs)
    if name == "deepseek_v3":  # (speculative decoding cannot rewind Qwen3-Next's states)
        out, _ = speculative_generate(model, x, max_new_tokens=12)
        np.testing.assert_array_equal(np.asarray(out),
                                      np.asarray(generate(model, x, max_new_tokens=12)))
    with pytest.raises(ValueError, match="mtp_depth"):  # transformers has no MTP to export
        hf.export(model, str(tmp_path / "export"))


def test_a_checkpoint_without_its_mtp_layer_loads_without_mtp(tmp_path):
    """transformers' own saves drop the MTP layer even when the config counts one."""
    _save("deepseek_v3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hf.load(str(tmp_path))[1].mtp_depth == 0


def test_qwen3_next_deeper_mtp_is_refused_by_name():
    assert qwen3_next.mtp_depth({}, ["mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"]) == 1
    assert qwen3_next.mtp_depth({}, ["model.norm.weight"]) == 0
    with pytest.raises(NotImplementedError, match="mtp.layers.1"):
        qwen3_next.mtp_depth({}, ["mtp.fc.weight", "mtp.layers.1.input_layernorm.weight"])
