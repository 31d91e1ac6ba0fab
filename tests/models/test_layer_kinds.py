"""A layer kind is one record in `tfjax.models.LAYER_KINDS`, and every reader takes
what it knows of the kind from there: register a new kind (a test double here) and
the build-time name check accepts it (and applies its decoder-only rule), the stack
builds its mixer (NoPE, as its record says), its mask rule reaches the forward
pass, the cache gets its state and slots, the decode masks its window, the position
biases skip it, and the trainer's zig-zag fallback reads its order dependence. The
same for an ffn kind's builder and order dependence."""

import importlib
import inspect
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfjax.models
import tfjax.nn
import tfjax.nn.ffn
from tfjax import models
from tfjax.config import MeshConfig, RunConfig, model_config
from tfjax.inference import generate
from tfjax.models import FFN_KINDS, LAYER_KINDS, FfnKind, LayerKind, attention_inputs, layer_kinds
from tfjax.nn.attention import KVCache, MultiHeadAttention
from tfjax.ops import masks
from tfjax.parallel.mesh import make_mesh
from tfjax.train.trainer import zigzag_devices

TINY = dict(vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, max_len=64,
            norm="rmsnorm", init_std=1.0, tie_embeddings=False)
WINDOW = 1  # the double sees the key before the query and itself


@pytest.fixture
def fake(monkeypatch):
    """Registers layer kind "fake" (NoPE attention over a window of 1, a rolling
    buffer of 2 slots, decoder only, order dependent) and ffn kind "fake_ffn" for one
    test; returns the mixer builder's calls."""
    calls = []

    def mixer(cfg, rngs, *, positions):
        calls.append(positions)
        return layer_kinds.attention(cfg, rngs, positions=positions)

    def mask(cfg, base, bidirectional):
        return masks.combine(base, masks.sliding_window(WINDOW, WINDOW if bidirectional else 0))

    def slots(cfg, max_len):
        return min(WINDOW + 1, max_len), WINDOW

    kind = LayerKind("a test double", mixer, mask=mask, positions=False, slots=slots, decoder_only=True, order_dependent=True)
    ffn = FfnKind("a test double", lambda cfg, rngs: None,
                  order_dependence=lambda cfg: "fake_ffn reads the tokens in order")
    monkeypatch.setitem(LAYER_KINDS._items, "fake", kind)
    monkeypatch.setitem(FFN_KINDS._items, "fake_ffn", ffn)
    return calls


def test_an_unregistered_kind_is_a_build_time_error():
    cfg = model_config(dict(TINY, layer_pattern=("global", "fake")))  # the config has no list
    with pytest.raises(ValueError, match=r"model.layer_pattern\[1\]: got 'fake'; allowed: "
                                         r"'chunked', 'cross', 'gated_deltanet', 'global', 'linear', "
                                         r"'local', 'mamba'"):
        models.check_names(cfg)
    with pytest.raises(ValueError, match=r"model.ffn_pattern\[0\]"):
        models.build(dict(TINY, ffn_pattern=("fake_ffn",)))


def test_one_registration_reaches_every_reader(fake):
    cfg = model_config(dict(TINY, num_layers=3, layer_pattern=("global", "fake"),
                            ffn_pattern=("dense", "fake_ffn")))
    assert models.check_names(cfg) is cfg  # the name check reads the registry
    with pytest.raises(ValueError, match="'fake' layers are causal mixers for arch='decoder'"):
        models.check_names(model_config(dict(TINY, arch="encoder", layer_pattern=("fake",))))

    # The stack: the record's mixer, with the record's positions (NoPE), and its ffn.
    model = models.build(cfg, rngs=nnx.Rngs(3))
    assert fake == [False]  # built once: position 1 of the one scanned cycle
    glob, double = model.layers.cycles.layers
    assert isinstance(double.attn, MultiHeadAttention) and double.attn.rope is None
    assert glob.attn.rope is not None and double.ffn is None and glob.ffn is not None

    # Masks and biases: the record's mask rule; no position bias for a NoPE kind.
    got = attention_inputs.layer_masks(cfg, masks.causal())
    want = masks.causal() & masks.sliding_window(WINDOW, 0)
    np.testing.assert_array_equal(got["fake"].dense(6, 6), want.dense(6, 6))
    np.testing.assert_array_equal(got["global"].dense(6, 6), masks.causal().dense(6, 6))
    alibi = model_config(dict(TINY, position="alibi", layer_pattern=("global", "fake")))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    biases = attention_inputs.layer_biases(alibi, None, pos, pos)
    assert biases["global"] is not None and biases["fake"] is None

    # The cache: the mixer's state, as many slots as its record says; decode masks
    # take its window.
    cache = jax.eval_shape(lambda: model.init_cache(2, 16))
    state = cache.layers["cycles"][1]["attn"]
    assert isinstance(state, KVCache) and state.window == WINDOW
    assert state.k.shape == (1, 2, 2, WINDOW + 1, cfg.head_size)  # [cycles, B, K, slots, H]
    assert cache.layers["cycles"][0]["attn"].k.shape[3] == 16  # global: every position
    step_masks, _ = attention_inputs.cache_masks(
        cfg, None, jnp.zeros((2, 1), jnp.int32), lambda size: jnp.zeros((2, size), jnp.int32), 16)
    assert step_masks["fake"].window == WINDOW and step_masks["global"].window == 0
    assert step_masks["fake"].kv_positions.shape == (2, WINDOW + 1)
    assert models.cache_bytes(cfg, 2, 16) == 2 * 2 * 2 * cfg.head_size * 4 * (2 * 16 + WINDOW + 1)

    # The trainer's zig-zag fallback: the records' order dependence.
    mesh = make_mesh(MeshConfig(data=4, sequence=2), jax.devices()[:8])
    run = RunConfig(model=cfg).validate()
    n, note = zigzag_devices(run, mesh)
    assert n == 0 and "layer_pattern has 'fake' layers" in note
    assert "fake_ffn reads the tokens in order" in note
    assert zigzag_devices(RunConfig(model=model_config(TINY)).validate(), mesh) == (2, None)


def _recompute_greedy(model, prompt, n):
    buf = np.zeros((prompt.shape[0], prompt.shape[1] + n), np.int32)
    buf[:, :prompt.shape[1]] = prompt
    f = nnx.jit(lambda m, t: m(t))
    for t in range(prompt.shape[1], prompt.shape[1] + n):
        buf[:, t] = np.asarray(f(model, jnp.asarray(buf)))[:, t - 1].argmax(-1)
    return buf[:, prompt.shape[1]:]


def test_a_registered_kind_generates_as_it_computes(fake):
    """Cached generation through the double's rolling buffer (its record's cache and
    slots) equals recomputing its full-sequence form (its record's mask rule)."""
    model = models.build(dict(TINY, num_layers=2, layer_pattern=("fake", "global")),
                         rngs=nnx.Rngs(3))
    x = np.asarray(jax.random.randint(jax.random.key(0), (2, 5), 0, 61))
    got = np.asarray(generate(model, x, max_new_tokens=6))
    np.testing.assert_array_equal(got, _recompute_greedy(model, x, 6))
    assert len(set(got.ravel().tolist())) > 3


def _dependence(model, tokens, t):
    """Per source position s: whether changing token s changes the logits at t."""
    f = nnx.jit(lambda m, x: m(x)[:, t])
    base = f(model, tokens)
    return np.array([not np.allclose(f(model, tokens.at[:, s].set((tokens[:, s] + 1) % 61)), base)
                     for s in range(tokens.shape[1])])


def test_the_attention_kinds_of_2024_26_models():
    """chunked (Llama 4): a query sees only its own chunk, and its cache is one
    chunk of slots; nope: no RoPE, Llama 4's query temperature; local with its own
    RoPE base (Gemma 3: unscaled, while global layers keep the scaled RoPE); QK-norm
    over the whole projection (OLMo 2)."""
    C = 3
    cfg = model_config(dict(TINY, num_layers=1, layer_pattern=("chunked",),
                            attention=dict(chunk=C)))
    model = models.build(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, 61)
    got = attention_inputs.layer_masks(cfg, masks.causal())["chunked"].dense(8, 8)
    np.testing.assert_array_equal(got, masks.chunked_causal(C).dense(8, 8))
    dep = _dependence(model, tokens, 7)  # chunk [6, 9): positions 6, 7 only
    assert not dep[:6].any() and dep[6:].all()
    cache = jax.eval_shape(lambda: model.init_cache(2, 40))
    assert cache.layers["cycles"][0]["attn"].k.shape == (1, 2, 2, C, cfg.head_size)
    q, kv = jnp.array([[7]]), jnp.array([[6, 7, 5]])  # a 3-slot ring buffer after 8 tokens
    m = attention_inputs.cache_masks(cfg, None, q, lambda size: kv, 40)[0]["chunked"]
    np.testing.assert_array_equal(m.dense(1, 3)[0, 0], [True, True, False])
    with pytest.raises(ValueError, match="model.attention.chunk"):
        model_config(dict(TINY, layer_pattern=("chunked",)))

    cfg = model_config(dict(TINY, num_layers=3, layer_pattern=("local", "global", "nope"),
                            rope=dict(theta=1e4, scaling="linear", factor=8.0),
                            attention=dict(sliding_window=4, local_rope_theta=10.0, qk_norm=True,
                                           qk_norm_over="projection", temperature_floor=4)))
    local, glob, nope = models.build(cfg, rngs=nnx.Rngs(0)).layers.cycles.layers
    local_rope, global_rope = local.attn.rope.rope, glob.attn.rope.rope  # their RopeConfigs
    assert (local_rope.theta, local_rope.scaling) == (10.0, "none")
    assert (global_rope.theta, global_rope.scaling, global_rope.factor) == (1e4, "linear", 8.0)
    assert nope.attn.rope is None and nope.attn.temperature == (4, 0.1)
    assert local.attn.temperature is None and glob.attn.q_norm.scale.shape == (1, 4 * 8)  # scanned


def test_llama4_qk_norm_is_weightless_and_on_the_rope_layers_only():
    """`attention.qk_norm_layers="rope"` with `attention.qk_norm_kind="rmsnorm_unit"` (Llama 4): the
    chunked (RoPE) layers normalise q and k by their RMS with no parameters, the NoPE
    layer has no QK-norm; the model still differs from one without the norm."""
    base = dict(vocab_size=61, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=48,
                max_len=64, layer_pattern=3 * ("chunked",) + ("nope",), scan_layers=False,
                attention=dict(chunk=4, qk_norm=True, qk_norm_kind="rmsnorm_unit",
                               qk_norm_layers="rope"))
    model = models.build(model_config(base), rngs=nnx.Rngs(0))
    norms = [node.q_norm for _, node in nnx.iter_graph(model) if hasattr(node, "q_norm")]
    assert [n is not None for n in norms] == [True, True, True, False]
    assert not nnx.state(norms[0], nnx.Param)  # weightless
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
    want = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + model.config.norm_eps)
    np.testing.assert_allclose(norms[0](x), want, rtol=1e-5, atol=1e-6)
    tokens = jax.random.randint(jax.random.key(1), (1, 9), 0, 61)
    def with_attention(**kw):
        return model_config({**base, "attention": {**base["attention"], **kw}})

    plain = models.build(with_attention(qk_norm=False), rngs=nnx.Rngs(0))
    assert not np.allclose(model(tokens), plain(tokens), atol=1e-4)
    with pytest.raises(ValueError, match="model.attention.qk_norm_layers: got 'nope'"):
        models.build(with_attention(qk_norm_layers="nope"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model.attention.qk_norm_kind: got 'l2'"):
        models.build(with_attention(qk_norm_kind="l2"), rngs=nnx.Rngs(0))


MAX_CONSTRUCTOR_PARAMETERS = 15  # layers take config records whole, not 30 keywords


def _module_classes():
    """Every `nnx.Module` subclass defined in a module of `tfjax.nn` or `tfjax.models`."""
    for package in (tfjax.nn, tfjax.models):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, nnx.Module)
                        and obj.__module__ == module.__name__):
                    yield obj


def _too_wide() -> dict[str, int]:
    """name -> constructor parameters (self not counted) of the classes over the limit."""
    width = {f"{c.__module__}.{c.__qualname__}": len(inspect.signature(c.__init__).parameters) - 1
             for c in _module_classes()}
    assert "tfjax.nn.attention.MultiHeadAttention" in width and len(width) > 15
    return {name: n for name, n in width.items() if n > MAX_CONSTRUCTOR_PARAMETERS}


def test_no_layer_constructor_is_wide(monkeypatch):
    """No layer or model constructor takes more than 15 parameters (dtypes, init scales
    and rngs included): a layer's knobs come as its config section's record
    (`Mamba(d_model, cfg.ssm)`). A wide one planted in `tfjax.nn.ffn` is found."""
    assert _too_wide() == {}

    class Wide(nnx.Module):
        def __init__(self, a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p):  # 16
            pass

    Wide.__module__ = "tfjax.nn.ffn"
    monkeypatch.setattr(tfjax.nn.ffn, "Wide", Wide, raising=False)
    assert _too_wide() == {"tfjax.nn.ffn.test_no_layer_constructor_is_wide.<locals>.Wide": 16}
