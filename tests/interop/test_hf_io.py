"""tfjax.interop.hf beyond per-family parity: export round trip (Llama), sharded and
bfloat16 checkpoints, placement on a mesh, clear errors, and `python -m tfjax.generate --hf`."""

from __future__ import annotations

import dataclasses
import io
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.config import MeshConfig, model_config  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file  # noqa: E402
from tfjax import models  # noqa: E402
from tfjax.models import build  # noqa: E402
from tfjax.parallel.mesh import make_mesh  # noqa: E402


LLAMA = dict(arch="decoder", vocab_size=80, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
             d_ff=40, activation="swiglu", norm="rmsnorm", norm_eps=1e-6, ffn_bias=False,
             tie_embeddings=False, position="rope", init_std=0.1, max_len=64,
             rope=dict(theta=500.0, scaling="llama3", factor=4.0, original_max_len=16))


def _params(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_llama_export_round_trip(tmp_path):
    model = build(model_config(LLAMA), rngs=nnx.Rngs(1))
    hf.export(model, str(tmp_path))
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = np.random.default_rng(0).integers(0, 80, size=(2, 12))
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids)))
    assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))

    # Back into tfjax on a mesh: the same parameters, each sharded by its logical axes.
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    loaded, cfg = hf.load(str(tmp_path), mesh=mesh)
    # the same model (head_dim is explicit in HF configs; init_std is not saved)
    assert dataclasses.replace(model.config, head_dim=8, init_std=cfg.init_std) == cfg
    a, b = _params(model), _params(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    q = nnx.state(loaded, nnx.Param)["layers"]["cycles"]["layers"][0]["attn"]["q"]["kernel"]
    assert q.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)

    # bfloat16 on disk (raw safetensors BF16) loads as bfloat16 parameters.
    hf.export(model, str(tmp_path / "bf16"), dtype="bfloat16")
    half, cfg16 = hf.load(str(tmp_path / "bf16"))
    assert cfg16.param_dtype == "bfloat16"
    for k, v in _params(half).items():
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(v, a[k].astype(jnp.bfloat16))


def test_export_refuses_non_llama():
    model = build(model_config(dict(LLAMA, attention=dict(qk_norm=True))),  # Qwen3, not Llama
                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model.attention.qk_norm"):
        hf.export(model, "/nonexistent", family="llama")


def test_safetensors_reader_matches_torch(tmp_path):
    from safetensors.torch import save_file as torch_save

    t = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.int64),
         "c": torch.randn(2, 2, 2)}
    torch_save(t, str(tmp_path / "x.safetensors"))
    ck = SafetensorsCheckpoint(str(tmp_path))
    assert sorted(ck) == ["a", "b", "c"] and ck["a"].dtype == ml_dtypes.bfloat16
    for k, v in t.items():
        np.testing.assert_array_equal(np.asarray(ck[k], np.float64), v.double().numpy())
    # and ours writes what safetensors (the reference implementation) reads
    save_file({k: np.asarray(ck[k]) for k in ck}, str(tmp_path / "y.safetensors"))
    from safetensors.numpy import load_file

    back = load_file(str(tmp_path / "y.safetensors"))
    np.testing.assert_array_equal(back["b"], t["b"].numpy())
    np.testing.assert_array_equal(back["c"], t["c"].numpy())


def _gpt2(path, **kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  **kw)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(str(path), max_shard_size="20KB")
    return model


def test_sharded_checkpoint(tmp_path):
    ref = _gpt2(tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    model, cfg = hf.load(str(tmp_path))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    p = nnx.state(model, nnx.Param)
    np.testing.assert_array_equal(p["embed"]["tokens"]["embedding"].get_value(),
                                  sd["transformer.wte.weight"])
    layer1 = p["layers"]["cycles"]["layers"][0]
    np.testing.assert_array_equal(layer1["ffn"]["wo"]["kernel"].get_value()[1],
                                  sd["transformer.h.1.mlp.c_proj.weight"])
    np.testing.assert_array_equal(layer1["attn"]["k"]["kernel"].get_value()[1].reshape(32, 32),
                                  sd["transformer.h.1.attn.c_attn.weight"][:, 32:64])
    # placed unrolled (for decoding): layer 1 is block 1, the same model as unrolled()
    flat, cfg_flat = hf.load(str(tmp_path), scan_layers=False)
    assert cfg_flat.scan_layers is False and flat.layers.cycles is None
    np.testing.assert_array_equal(
        nnx.state(flat, nnx.Param)["layers"]["blocks"][1]["ffn"]["wo"]["kernel"].get_value(),
        sd["transformer.h.1.mlp.c_proj.weight"])
    a, b = _params(flat), _params(models.unrolled(model))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_clear_errors(tmp_path):
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(NotImplementedError, match="rope_type='longrope'"):
        hf.config_from_hf(dict(base, rope_parameters=dict(rope_type="longrope", factor=2.0)))
    with pytest.raises(NotImplementedError, match="hidden_act='tanh'"):
        hf.config_from_hf(dict(base, hidden_act="tanh"))
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        hf.config_from_hf(base, dtype="int8")
    with pytest.raises(ValueError, match="model_type"):
        hf.config_from_hf(dict(base, model_type="gpt_bigcode"))
    with pytest.raises(NotImplementedError, match="scale_attn_by_inverse_layer_idx"):
        hf.config_from_hf(dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                               n_positions=32, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="config.json"):
        hf.load(str(tmp_path))
    # A tensor the mapping does not read (a feature we would drop) is an error.
    _gpt2(tmp_path)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    save_file({"transformer.h.0.attn.extra.weight": np.zeros(3, np.float32)},
              str(tmp_path / "extra.safetensors"))
    idx["weight_map"]["transformer.h.0.attn.extra.weight"] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(NotImplementedError, match="attn.extra.weight"):
        hf.load(str(tmp_path))


def test_generate_cli_hf(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from tfjax.generate import main

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, initializer_range=0.2, eos_token_id=47)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(str(tmp_path))
    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(48)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompt = "w5 w17 w3 w40"
    ids = torch.tensor([tok.encode(prompt).ids])
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    want = gen[:gen.index(47)] if 47 in gen else gen
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert main(["--hf", str(tmp_path), "--prompt", prompt, "--max_new_tokens", "6"]) == 0
    assert out.getvalue() == prompt + tok.decode(want) + "\n"
    assert main(["--hf", str(tmp_path / "missing"), "--prompt", "w1"]) == 2


def test_export_with_tokenizer_runs_generate_cli(tmp_path):
    """`hf.export(..., tokenizer=the run's)` writes what `python -m tfjax.generate --hf`
    needs (tokenizer.json, bos / eos ids): its continuation is HF `generate`'s on the
    same export, read with transformers' AutoTokenizer and generation_config.json."""
    import contextlib

    from tfjax.data import ByteTokenizer
    from tfjax.generate import load_hf, main

    tok = ByteTokenizer()
    model = build(model_config(dict(LLAMA, vocab_size=tok.vocab_size, num_layers=1,
                                    init_std=0.5)), rngs=nnx.Rngs(3))
    hf.export(model, str(tmp_path), tokenizer=tok)
    assert load_hf(str(tmp_path))[3] == (tok.eos_id,)
    prompt = "héllo wörld"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--hf", str(tmp_path), "--prompt", prompt, "--max_new_tokens", "8"]) == 0

    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = auto(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == [tok.bos_id, *tok.encode(prompt)]  # as training began documents
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert (ref.generation_config.bos_token_id, ref.generation_config.eos_token_id) == (
        tok.bos_id, tok.eos_id)
    with torch.no_grad():
        gen = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    want = gen[:gen.index(tok.eos_id)] if tok.eos_id in gen else gen
    assert out.getvalue() == prompt + tok.decode(want) + "\n"


def test_export_refuses_a_tokenizer_larger_than_the_model(tmp_path):
    from tfjax.data import ByteTokenizer

    model = build(model_config(LLAMA), rngs=nnx.Rngs(0))  # vocab 80 < the byte tokenizer's 259
    with pytest.raises(ValueError, match="export: the tokenizer has 259 ids but model.vocab_size "
                                         "is 80"):
        hf.export(model, str(tmp_path / "out"), tokenizer=ByteTokenizer())
    assert not os.path.exists(tmp_path / "out")
