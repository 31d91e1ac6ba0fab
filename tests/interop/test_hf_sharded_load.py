"""`tfjax.interop.hf.load(path, mesh=...)`: each parameter built device block by device
block from the memory-mapped checkpoint (`hf_invert.Symbolic.block`), with every value
and sharding the eager path (the whole model in host memory, then `device_put`) gives."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")

from tfjax.config import MeshConfig  # noqa: E402
from tfjax.interop import hf  # noqa: E402
from tfjax.interop.hf_invert import Symbolic, stack, symbolic_checkpoint  # noqa: E402
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file  # noqa: E402
from tfjax.interop.tensor_mapping import Weights  # noqa: E402
from tfjax.parallel.mesh import make_mesh  # noqa: E402

V = 96
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
            tie_word_embeddings=False)
CASES = {  # scanned experts; dense layer 0 unrolled before routed ones; fused QKV (two ways)
    "mixtral": (lambda: transformers.MixtralConfig(**BASE, num_local_experts=4,
                                                   num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        mlp_only_layers=[0]), "Qwen3MoeForCausalLM"),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                             n_positions=32), "GPT2LMHeadModel"),
    "neox": (lambda: transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4), "GPTNeoXForCausalLM"),
}


def _save(name, path):
    make, cls = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(make())
    with torch.no_grad():
        for p in model.parameters():  # distinct values everywhere (norms start at 1)
            p.copy_(torch.randn_like(p))
    model.save_pretrained(path)


def _state(model):
    return dict(nnx.to_flat_state(nnx.state(model)))


def _eager_on_mesh(path, mesh, dtype):
    """Today's mesh path: the whole mapping evaluated in host memory, then device_put."""
    raw = hf._read_config(path)
    cfg = hf.config_from_hf(raw, dtype=dtype)
    family = hf.FAMILIES.get(raw["model_type"])
    w = Weights(SafetensorsCheckpoint(path), (family.prefix,) if family.prefix else ())
    return hf.load_state(family.weights(w, cfg, raw), cfg, mesh=mesh)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_load_equals_eager_load(tmp_path, name):
    _save(name, str(tmp_path))
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    for dtype in (None, "bfloat16"):  # the checkpoint's float32, and a cast
        sharded, cfg = hf.load(str(tmp_path), mesh=mesh, dtype=dtype)
        plain, _ = hf.load(str(tmp_path), dtype=dtype)
        if dtype is None:
            assert cfg.scan_layers and "cycles" in dict(nnx.state(sharded))["layers"]
        old = _state(_eager_on_mesh(str(tmp_path), mesh, dtype))
        a, b = _state(sharded), _state(plain)
        assert a.keys() == b.keys() == old.keys()
        for k in a:
            x, y = a[k].get_value(), b[k].get_value()
            assert x.dtype == y.dtype and x.shape == y.shape, k
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8),
                                          np.asarray(y).view(np.uint8), err_msg=str(k))
            assert x.sharding == old[k].get_value().sharding, k


def test_sharded_load_keeps_the_leftover_check(tmp_path):
    _save("gpt2", str(tmp_path))
    save_file({"extra.weight": np.zeros((2, 2), np.float32)},
              str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(NotImplementedError, match="extra.weight"):
        hf.load(str(tmp_path), mesh=make_mesh(MeshConfig(fsdp=8)))


def test_block_reads_only_the_members_it_covers():
    shapes = {f"e{i}": (6, 4) for i in range(4)}
    leaves = symbolic_checkpoint(shapes)
    rng = np.random.default_rng(0)
    data = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    # per "layer" a stack over experts of a moved tensor; the layers stacked again
    layers = [np.stack([leaves[f"e{2 * j + e}"].T.reshape(2, 2, 6) for e in range(2)])
              for j in range(2)]
    whole = stack(layers)
    assert isinstance(whole, Symbolic) and whole.shape == (2, 2, 2, 2, 6)
    full = np.stack([np.stack([data[f"e{2 * j + e}"].T.reshape(2, 2, 6) for e in range(2)])
                     for j in range(2)])
    read = []

    def tensor(n):
        read.append(n)
        return data[n]

    key = (slice(1, 2), slice(0, 1), slice(0, 2), slice(1, 2), slice(2, 5))
    np.testing.assert_array_equal(whole.block(key, tensor, np.float32), full[key])
    assert read == ["e2"]  # layer 1, expert 0 only
    read.clear()
    key = (slice(0, 2), slice(1, 2), slice(0, 2), slice(0, 2), slice(0, 6))
    np.testing.assert_array_equal(whole.block(key, tensor, np.float32), full[key])
    assert read == ["e1", "e3"]
    concat = np.concatenate([leaves["e0"], leaves["e1"]], axis=1)  # (6, 8)
    read.clear()
    key = (slice(2, 4), slice(5, 7))
    np.testing.assert_array_equal(concat.block(key, tensor, np.float32),
                                  np.concatenate([data["e0"], data["e1"]], axis=1)[key])
    assert read == ["e1"]
    as_bf16 = concat.block(key, tensor, ml_dtypes.bfloat16)  # the cast astype makes
    np.testing.assert_array_equal(as_bf16.view(np.uint16), np.concatenate(
        [data["e0"], data["e1"]], axis=1)[key].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert concat.block(key, tensor).dtype == np.float32  # default: the tensors' dtype
    for bad in ((slice(0, 1),), (slice(0, 1), slice(None))):
        with pytest.raises(ValueError, match="slices"):
            concat.block(bad, tensor)
