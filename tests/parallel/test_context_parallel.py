"""Long-context training through the trainer: on a data=2 x sequence=4 mesh the
real decoder's self-attention runs as ring attention (or the all-gather baseline)
over the `sequence` axis, and a few training steps match one device. Ring runs with
`model.attention.zigzag="data"` (the default): the trainer puts each batch in zig-zag order
once and the layers skip the per-layer re-layout. A model's `attention_impl` reaches
the ring (as its per-block attention) and all-gather (per device)."""

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfjax.ops.blockwise as blockwise_lib
import tfjax.ops.pallas.mosaic_tpu as tpu_lib
from tfjax import config as C
from tfjax.config import AttentionConfig
from tfjax import models
from tfjax.models import build
from tfjax.nn.attention import MultiHeadAttention
from tfjax.ops import masks
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import use_rules
from tfjax.parallel.zigzag import zigzag, zigzag_data
from tfjax.train import Trainer
from tfjax.train.trainer import build_program, zigzag_devices, zigzag_rows

cp_lib = sys.modules["tfjax.parallel.context_parallel"]
# The module (tfjax.parallel.ring_attention is also the exported function).
ring_lib = sys.modules["tfjax.parallel.ring_attention"]


def _config(seq_len=32, model=None, **mesh):
    # seq_len 32 over sequence=4: 8 tokens a device, zig-zag chunks of 4 (T % 2n == 0).
    # init_std 0.3 makes attention sharp enough that a position or mask read in the
    # wrong order moves the losses by > 0.1 (at 0.02, positions left in natural order
    # under zig-zag data still matched within 1e-4).
    model = dict(model or {})
    attention = dict(context_parallel=mesh.pop("cp", "ring"), **model.pop("attention", {}))
    return C.from_dict(C.RunConfig, dict(
        model={**dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                      num_layers=1, position="rope", init_std=0.3), **model,
               "attention": attention},
        train=dict(steps=3, batch_size=4, seq_len=seq_len, warmup_steps=1, lr=1e-2, log_every=1,
                   eval_batches=1, eval_at_end=False, sample_tokens=0, progress=False),
        checkpoint=dict(enabled=False, every_steps=0, async_save=False),
        mesh=mesh))


def _losses(tmp_path, name, n, trainers=None, **mesh):
    tr = Trainer(_config(**mesh), str(tmp_path / name), devices=jax.devices()[:n],
                 log=lambda s: None)
    if trainers is not None:
        trainers.append(tr)
    hist = tr.train()["history"]
    return [hist[k] for k in sorted(hist)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("one"), "one", 1, data=1)


@pytest.mark.parametrize("mode", ["ring", "all_gather", "ulysses", "usp"])
def test_sequence_parallel_training_matches_one_device(tmp_path, one_device, mode, monkeypatch):
    # Record which sequence-parallel attention the layer really ran.
    calls, layouts = [], set()
    for name in ("ring_attention", "all_gather_attention", "ulysses_attention", "usp_attention"):
        inner = getattr(cp_lib, name)

        def spy(*args, _inner=inner, _name=name, **kwargs):
            calls.append(_name)
            layouts.add((kwargs.get("load_balance"), kwargs.get("natural_order")))
            return _inner(*args, **kwargs)

        monkeypatch.setattr(cp_lib, name, spy)
    trainers = []
    usp = dict(model=dict(attention=dict(ulysses_size=2))) if mode == "usp" else {}
    got = _losses(tmp_path, mode, 8, trainers, data=2, sequence=4, cp=mode, **usp)
    assert len(got) == 3 == len(one_device)
    np.testing.assert_allclose(got, one_device, rtol=1e-4, atol=1e-4)
    assert set(calls) == {f"{mode}_attention"}
    if mode in ("ring", "usp"):  # zigzag="data": batches reordered once, no per-layer re-layout
        assert trainers[0].program.zigzag == 4
        assert layouts == {("zigzag", False)}


def _permutes(zigzag: str) -> int:
    """collective_permutes in the lowered (not compiled) eval step on data=2 x sequence=4."""
    cfg = _config(model=dict(attention=dict(zigzag=zigzag)), data=2, sequence=4)
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    p = build_program(cfg, mesh, build)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         p.abstract_state, p.state_shardings)
    batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=p.batch_sharding)
             for k in ("inputs", "targets", "positions", "segment_ids", "mask", "target_bytes")}
    return p.eval.lower(state, batch).as_text().count("collective_permute")


def test_zigzag_data_drops_the_per_layer_relayout():
    # "layer" re-lays out q, k, v, the segment ids and the output with half-chunk
    # ppermutes in every layer; "data" reorders the batch on the host instead. (The
    # eval step traces the same layers as the train step, without the backward.)
    data, layer = _permutes("data"), _permutes("layer")
    assert 0 < data < layer, (data, layer)


def test_zigzag_plan_and_host_reorder():
    mesh = make_mesh(C.MeshConfig(data=2, sequence=4), jax.devices()[:8])
    assert zigzag_devices(_config(data=2, sequence=4), mesh) == (4, None)
    assert zigzag_devices(_config(data=2, sequence=4), mesh, build) == (4, None)
    n, note = zigzag_devices(_config(data=2, sequence=4), mesh, lambda cfg, rngs: None)
    assert n == 0 and "custom build_model" in note  # e.g. tests/train/tiny_decoder.py
    for kw in (dict(model=dict(attention=dict(zigzag="layer"))), dict(cp="all_gather")):
        assert zigzag_devices(_config(data=2, sequence=4, **kw), mesh) == (0, None)
    # ALiBi / T5's bias reach the ring as slopes / the table + the batch's (reordered)
    # positions
    for position in ("alibi", "t5"):
        cfg = _config(data=2, sequence=4, model=dict(position=position))
        assert zigzag_devices(cfg, mesh) == (4, None)
    # Order-dependent layers / lengths: fall back to natural order, with a note.
    for kw, why in ((dict(model=dict(layer_pattern=("global", "linear"))), "'linear'"),
                    (dict(seq_len=36), "seq_len=36")):
        n, note = zigzag_devices(_config(data=2, sequence=4, **kw), mesh)
        assert n == 0 and why in note and "model.attention.zigzag='layer'" in note
    x = np.arange(3 * 32).reshape(3, 32)
    np.testing.assert_array_equal(zigzag_rows(x, 4), np.asarray(zigzag(x, 4)))


def test_zigzag_data_refuses_what_it_cannot_read():
    # Under the trainer's zig-zag layout a bias array would be read against
    # natural-order positions: an error, not a wrong answer.
    cfg = _config(data=2, sequence=4)
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    attn = nnx.eval_shape(lambda: MultiHeadAttention(32, 4, rngs=nnx.Rngs(0)))
    q = np.zeros((2, 32, 4, 8), np.float32)  # only shapes are read before the errors
    with use_rules(mesh, logical_rules(cfg.mesh.rules)), zigzag_data(4):
        with pytest.raises(ValueError, match="zigzag='layer'"):
            attn.attend(q, q, q, masks.causal(), bias=np.zeros((2, 4, 32, 32), np.float32))
        with pytest.raises(ValueError, match="T % 8 == 0"):
            attn.attend(q[:, :28], q[:, :28], q[:, :28], masks.causal())
        with pytest.raises(ValueError, match="zigzag='none'"):
            unbalanced = AttentionConfig(zigzag="none")
            nnx.eval_shape(lambda: MultiHeadAttention(32, 4, attention=unbalanced,
                                                      rngs=nnx.Rngs(0))).attend(q, q, q)


def test_context_parallel_is_validated():
    with pytest.raises(ValueError, match="model.attention.context_parallel"):
        _config(cp="gather").validate()
    with pytest.raises(ValueError, match="context_parallel"):
        MultiHeadAttention(32, 4, attention=AttentionConfig(context_parallel="gather"),
                           rngs=nnx.Rngs(0))
    # Ulysses splits the query heads over the sequence axis: one line, before building
    with pytest.raises(ValueError, match=r"^model.attention.context_parallel: 'ulysses' gives "
                                         r"each of the mesh.sequence=8 devices num_heads / 8 "
                                         r"query heads, but num_heads=4; set mesh.sequence to a "
                                         r"divisor of 4, or use context_parallel='ring'"):
        _config(cp="ulysses", data=1, sequence=8).validate()
    _config(cp="ulysses", data=2, sequence=4).validate()
    with pytest.raises(ValueError, match=r"^model.attention.ulysses_size: 3 must divide "
                                         r"mesh.sequence=4 and num_heads=4"):
        _config(cp="usp", model=dict(attention=dict(ulysses_size=3)), sequence=4).validate()
    with pytest.raises(ValueError,
                       match=r"model.attention.zigzag: got 'zag'; allowed: 'data', 'layer'"):
        _config(model=dict(attention=dict(zigzag="zag"))).validate()
    with pytest.raises(ValueError, match="zigzag"):
        MultiHeadAttention(32, 4, attention=AttentionConfig(zigzag="zag"), rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- #
# model.attention.impl under context parallelism.
# --------------------------------------------------------------------------- #


def _model(**model):
    cfg = C.model_config(dict(vocab_size=61, d_model=32, num_layers=1, num_heads=4,
                              num_kv_heads=2, d_ff=48, max_len=64, init_std=0.3, **model))
    return models.build(cfg, rngs=nnx.Rngs(3))


def _loss(m, x):
    return m(x).astype(jnp.float32).mean()


def _on_a_sequence_mesh(model, x):
    """Loss and gradients of `model` on a sequence=4 CPU mesh under the default rules."""
    mesh = make_mesh(C.MeshConfig(data=1, sequence=4), jax.devices()[:4])
    rules = logical_rules(C.DEFAULT_RULES)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tree_shardings(state, mesh, rules)))

    @nnx.jit
    def sharded(m, x):
        with use_rules(mesh, rules):
            return nnx.value_and_grad(_loss)(m, x)

    return sharded(model, x)


def _spy(monkeypatch, calls, module, name, label):
    real = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, **kw: calls.update([label]) or real(*a, **kw))


@pytest.mark.parametrize("mode,impl,ran", [
    ("ring", "pallas", {"pallas forward", "pallas backward"}),  # the TPU kernels, interpreted
    ("ring", "blockwise", {"blockwise forward", "blockwise backward"}),
    ("all_gather", "xla", {"jax.nn"}),  # per device, through dot_product_attention
    ("all_gather", "auto", {"blockwise"}),  # blockwise, as all-gather always ran
    ("ulysses", "xla", {"jax.nn"}),  # per device, its heads over the whole sequence
    # through dot_product_attention: the kernel's own custom_vjp runs its backward kernels
    ("ulysses", "pallas", {"pallas forward"}),
    ("usp", "blockwise", {"blockwise forward", "blockwise backward"}),  # the ring's blocks
])
def test_a_models_attention_impl_reaches_context_parallel_attention(monkeypatch, mode, impl,
                                                                     ran):
    """`model.attention.impl` is what a sequence-parallel layer runs: per ring block
    (spied on the kernel families), or per device under all-gather; the loss and the
    parameter gradients equal the same model's on one device. (The ring's "auto" is
    the layer's default, run by every other sequence-parallel test; zigzag="none"
    keeps the ring to one block pair per step: the implementation is what is tested.)"""
    model = _model(attention=dict(impl=impl, context_parallel=mode, zigzag="none",
                                  ulysses_size=2 if mode == "usp" else 1))
    x = jax.random.randint(jax.random.key(0), (2, 32), 0, 61)
    want_l, want_g = nnx.jit(nnx.value_and_grad(_loss))(model, x)
    calls = collections.Counter()
    _spy(monkeypatch, calls, blockwise_lib, "blockwise_attention", "blockwise forward")
    _spy(monkeypatch, calls, blockwise_lib, "blockwise_attention_backward",
         "blockwise backward")
    _spy(monkeypatch, calls, tpu_lib, "flash_attention_tpu", "pallas forward")
    _spy(monkeypatch, calls, tpu_lib, "flash_attention_tpu_backward", "pallas backward")
    _spy(monkeypatch, calls, ring_lib, "blockwise_attention", "blockwise")  # all-gather's
    _spy(monkeypatch, calls, jax.nn, "dot_product_attention", "jax.nn")  # "xla"'s
    got_l, got_g = _on_a_sequence_mesh(model, x)
    assert set(calls) == ran, calls
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, atol=1e-4 * float(jnp.max(jnp.abs(b)))), nnx.state(got_g), nnx.state(want_g))


def test_an_implementation_context_parallelism_cannot_run_raises_while_tracing():
    """The ring has no "xla" block: one line naming what it runs, raised while tracing
    (before anything compiles). All-gather with "cudnn" (no GPU here, and no q
    offsets): the dispatch's reason, prefixed with where it came from."""
    x = jnp.zeros((2, 32), jnp.int32)
    with pytest.raises(ValueError) as e:
        _on_a_sequence_mesh(_model(attention=dict(impl="xla")), x)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("ring_attention: implementation='xla' has no ring block")
    assert str(e.value).endswith("implementation must be one of 'auto', 'blockwise', 'pallas'")
    with pytest.raises(ValueError, match=r"^all_gather_attention \(per device, .*\): "
                                         r"implementation='cudnn' cannot serve this call: "):
        _on_a_sequence_mesh(_model(attention=dict(impl="cudnn", context_parallel="all_gather")), x)
