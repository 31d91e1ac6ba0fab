"""Parity of `tfjax.interop.hf.load` with transformers for the recurrent and hybrid
families of `tfjax.interop.families` (Mamba-2, Qwen3-Next, Jamba): a random tiny
HF model (torch fallback paths, no CUDA kernels) is saved with `save_pretrained`,
loaded by tfjax and compared on fp32 logits (max |ours - theirs| <= 1e-4 * max
|theirs|) and on 20 greedy tokens of `tfjax.inference.generate` (prefill, then one
recurrent / cached step per token) against HF `generate` with its cache. MoE layers
load dropless (`moe.capacity_factor=0`), so no token is ever dropped."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.config import run_config  # noqa: E402
from hf_parity import assert_greedy_equal, assert_logits_close  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file  # noqa: E402
from tfjax.models import build  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

V = 96
MAMBA2 = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
              head_dim=8, num_heads=8, initializer_range=0.1)
# initializer_range 0.2: at 0.1 the greedy tokens of these hybrids (and tied heads)
# settle into repeating one token, which would compare little of the decode path
QWEN3_NEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
JAMBA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
             mamba_d_state=8, initializer_range=0.2, tie_word_embeddings=False)

# name -> (HF config factory, HF model class name, kind); kind "lm" checks logits and 20
# greedy tokens, "logits" the logits only (see the case's comment).
CASES = {
    # 2 groups of B / C (4 heads each) and of the gated norm; conv and projection
    # biases; tied head; a chunk shorter than the prompt (10 = 4 + 4 + 2)
    "mamba2": (lambda: transformers.Mamba2Config(
        **MAMBA2, n_groups=2, use_bias=True, use_conv_bias=True, chunk_size=4,
        tie_word_embeddings=True), "Mamba2ForCausalLM", "lm"),
    # one group, no conv bias, untied head, conv width 3
    "mamba2_untied": (lambda: transformers.Mamba2Config(
        **MAMBA2, n_groups=1, use_conv_bias=False, conv_kernel=3, tie_word_embeddings=False),
        "Mamba2ForCausalLM", "lm"),
    # dt clipped to [0.05, 0.2]: HF clips in the chunked prefill only (its one-token
    # decode step does not), so only the logits are compared
    "mamba2_dt_limit": (lambda: transformers.Mamba2Config(
        **MAMBA2, n_groups=4, time_step_limit=(0.05, 0.2)), "Mamba2ForCausalLM", "logits"),
    # 3 GDN : 1 gated attention (GQA 4/2, head 16, a quarter rotated), GVA 2 key : 4
    # value heads, MoE (4 experts, top 2, renormalised, shared expert + gate) on
    # every second layer except 3 (mlp_only_layers), dense MLPs elsewhere, biases
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(
        **QWEN3_NEXT, decoder_sparse_step=2, mlp_only_layers=[3], attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=100.0,
                             partial_rotary_factor=0.5)), "Qwen3NextForCausalLM", "lm"),
    # full attention every 2nd layer, all layers sparse, raw top-k gates, tied head,
    # equal key and value heads, conv width 3, linear RoPE scaling of HF's default
    # partial_rotary_factor
    "qwen3_next_tied": (lambda: transformers.Qwen3NextConfig(
        **dict(QWEN3_NEXT, tie_word_embeddings=True, linear_num_value_heads=2,
               linear_value_head_dim=16, linear_conv_kernel_dim=3, num_hidden_layers=2),
        layer_types=["linear_attention", "full_attention"], norm_topk_prob=False,
        rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=50.0)),
        "Qwen3NextForCausalLM", "lm"),
    # attention at 1 and 3 (period 2), MoE (4 experts, top 2, raw gates) at 2 (period 4,
    # offset 2), Mamba with dt rank 3, projection biases, no conv bias; GQA 4/2
    "jamba": (lambda: transformers.JambaConfig(
        **JAMBA, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4,
        expert_layer_offset=2, mamba_dt_rank=3, mamba_proj_bias=True, mamba_conv_bias=False),
        "JambaForCausalLM", "lm"),
    # attention at 2 only (period 4 > the 3 layers' reach), MoE on every layer (period
    # 1), top 1, tied head, conv width 3, expand 1
    "jamba_moe_everywhere": (lambda: transformers.JambaConfig(
        **dict(JAMBA, num_hidden_layers=3, tie_word_embeddings=True, num_experts_per_tok=1),
        attn_layer_period=4, attn_layer_offset=2, expert_layer_period=1, expert_layer_offset=0,
        mamba_d_conv=3, mamba_expand=1), "JambaForCausalLM", "lm"),
}


def _save(name, path):
    make, cls, kind = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # biases start at 0 and norm weights at 1 (or 0): a swapped
                p.add_(0.1 * torch.randn_like(p))  # or dropped one would go unnoticed
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
        assert_logits_close(model(jnp.asarray(ids)), ref(t_ids).logits)
        if kind != "lm":
            return
    assert_greedy_equal(model, ref, ids)


def _hf_dict(config) -> dict:
    """The config.json dict save_pretrained would write for `config`."""
    return json.loads(config.to_json_string())


BAD = {
    "mamba2": (lambda: transformers.Mamba2Config(**MAMBA2), (
        ("norm_before_gate", True, NotImplementedError),
        ("hidden_act", "gelu", NotImplementedError),
        ("num_heads", 4, ValueError))),
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT), (
        ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"], NotImplementedError),
        ("hidden_act", "gelu", NotImplementedError),
        ("shared_expert_intermediate_size", 0, NotImplementedError),
        ("layer_types", ["full_attention"] * 3, ValueError))),
    "jamba": (lambda: transformers.JambaConfig(**JAMBA), (
        ("hidden_act", "relu", NotImplementedError),
        ("attn_layer_offset", 8, ValueError))),
}


@pytest.mark.parametrize("family", list(BAD))
def test_bad_options_are_refused_by_name(family):
    make, bad = BAD[family]
    good = _hf_dict(make())
    hf.config_from_hf(good)  # the unmodified config maps
    for key, value, error in bad:
        with pytest.raises(error, match=key):
            hf.config_from_hf({**good, key: value})


def _preset(name):
    spec = importlib.util.spec_from_file_location(f"preset_{name}", CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return run_config(module.get_config("tiny")).model


@pytest.mark.parametrize("preset", ["mamba2", "qwen3_next", "jamba"])
def test_to_hf_describes_the_preset(preset, tmp_path):
    """`to_hf` of each family's tiny preset is a config transformers builds; the HF model
    of it loads back, and the preset's own config with those parameters computes HF's
    logits: the inverse mapping keeps every option that changes the computation."""
    cfg = _preset(preset)
    family = hf.FAMILIES.get(preset)
    d = family.to_hf(cfg)
    assert d["model_type"] == preset
    d = json.loads(json.dumps(d))  # what a config.json holds
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(**{**d, "initializer_range": 0.1})
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    ref.eval().save_pretrained(tmp_path)
    model, _ = hf.load(str(tmp_path))
    twin = build(cfg, rngs=nnx.Rngs(1))  # the preset's config, the checkpoint's parameters
    nnx.update(twin, nnx.state(model, nnx.Param))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 10))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits
    assert_logits_close(twin(jnp.asarray(ids)), theirs)


def _params(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(name, tmp_path):
    """load -> `hf.export` -> transformers' `from_pretrained`: the logits of the model
    saved; the same tensor names as `save_pretrained`; `load` again: every parameter
    bit for bit."""
    ref, _ = _save(name, tmp_path / "hf")
    model, cfg = hf.load(str(tmp_path / "hf"))
    hf.export(model, str(tmp_path / "out"))
    assert set(SafetensorsCheckpoint(str(tmp_path / "out"))) == set(
        SafetensorsCheckpoint(str(tmp_path / "hf")))
    back = type(ref).from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    ids = torch.tensor(np.random.default_rng(0).integers(3, V, size=(2, 10)))
    with torch.no_grad():
        assert_logits_close(back(ids).logits.numpy(), ref(ids).logits)
    again, _ = hf.load(str(tmp_path / "out"))
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_qwen3_next_reads_every_tensor_or_raises(tmp_path):
    """Qwen3-Next checkpoints carry an MTP module (`mtp.*`), which loads into
    `model.mtp` (tests/interop/test_hf_mtp.py); one that is incomplete, or any other
    tensor left unread, is an error naming it."""
    _save("qwen3_next_tied", tmp_path)
    file = str(tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    tensors = {k: np.array(ckpt[k]) for k in ckpt}
    save_file({**tensors, "mtp.fc.weight": np.zeros((32, 64), np.float32)}, file)
    with pytest.raises(ValueError, match="no tensor 'mtp.layers.0."):
        hf.load(str(tmp_path))
    save_file({**tensors, "model.layers.0.extra.weight": np.zeros((4,), np.float32)}, file)
    with pytest.raises(NotImplementedError, match="model.layers.0.extra.weight"):
        hf.load(str(tmp_path))


@pytest.mark.parametrize("preset,change,field", [
    ("mamba2", dict(mamba2=dict(norm_groups=2)), "norm_groups"),
    ("mamba2", dict(norm="layernorm"), "model.norm"),
    ("jamba", dict(layer_pattern=("global", "global", "mamba", "mamba")), "layer_pattern"),
    ("jamba", dict(ssm=dict(inner_norm=False)), "ssm.inner_norm"),
    ("qwen3_next", dict(moe=dict(shared_gate=False)), "moe.shared_gate"),
    ("qwen3_next", dict(layer_pattern=("mamba", "global")), "layer_pattern"),
])
def test_to_hf_refuses_what_the_family_cannot_hold(preset, change, field):
    cfg = _preset(preset)
    sections = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in change.items()
                if isinstance(v, dict)}
    cfg = dataclasses.replace(cfg, **{**change, **sections})
    with pytest.raises(ValueError, match=field):
        hf.FAMILIES.get(preset).to_hf(cfg)
