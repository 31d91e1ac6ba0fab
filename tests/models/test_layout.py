"""`StackLayout.where(i)` against the module tree `LayerStack` really builds, for
awkward depths: a depth that is not a multiple of the cycle, a cycle that is the
lcm of the two patterns, less than one cycle, `scan_layers=False`, and an
encoder-decoder whose two stacks differ in depth. And the layout is where the
computation happens: a scanned model's layers moved into an unrolled model by
`where(i)` compute the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import model_config
from tfjax.models import StackLayout
from tfjax.nn.attention import MultiHeadAttention
from tfjax.nn.ffn import FeedForward
from tfjax.nn.linear_attention import LinearAttention
from tfjax.nn.moe import MoE
from tfjax.nn.ssm import Mamba

TINY = dict(vocab_size=61, d_model=32, num_heads=4, d_ff=48, max_len=64, position="none",
            norm="rmsnorm", moe=dict(num_experts=4, experts_per_token=2),
            ssm=dict(d_state=4, chunk=4), linear=dict(chunk=4), attention=dict(sliding_window=2))
MIXERS = {"global": MultiHeadAttention, "local": MultiHeadAttention, "mamba": Mamba,
          "linear": LinearAttention}
FFNS = {"dense": FeedForward, "moe": MoE, "none": type(None)}

CASES = {
    # lcm(3, 2) = 6: one scanned cycle, one block left over.
    "lcm_cycle_plus_one": dict(num_layers=7, layer_pattern=("mamba", "global", "linear"),
                               ffn_pattern=("moe", "dense")),
    # 2 cycles of 2, one leftover.
    "two_cycles_plus_one": dict(num_layers=5, layer_pattern=("local", "global")),
    # fewer layers than one cycle: nothing to scan.
    "less_than_a_cycle": dict(num_layers=2, layer_pattern=("local", "global", "global")),
    "unscanned": dict(num_layers=5, layer_pattern=("local", "global"),
                      ffn_pattern=("dense", "none", "dense"), scan_layers=False),
    "exact_cycles": dict(num_layers=4, layer_pattern=("global", "local")),
}


def _abstract(cfg):
    return nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0)))


def _leading(module) -> set[int]:
    return {v.shape[0] for v in jax.tree.leaves(nnx.state(module, nnx.Param))}


def _check_stack(stack, layout: StackLayout):
    assert stack.layout == layout
    seen = []
    for i in range(layout.num_layers):
        where = layout.where(i)
        seen.append(where)
        if where[0] == "cycles":
            _, j, c = where
            block = stack.cycles.layers[j]
            assert 0 <= c < layout.num_cycles
            assert _leading(block) == {layout.num_cycles}  # stacked over the cycles
        else:
            block = stack.blocks[where[1]]
        assert isinstance(block.attn, MIXERS[layout.kind(i)]), (i, where)
        assert isinstance(block.ffn, FFNS[layout.ffn_kind(i)]), (i, where)
    # every layer lives in exactly one place, and every place holds one layer
    assert len(set(seen)) == layout.num_layers
    cycles = 0 if stack.cycles is None else len(stack.cycles.layers) * layout.num_cycles
    assert cycles + len(stack.blocks) == layout.num_layers
    assert len(stack.blocks) == layout.num_blocks


@pytest.mark.parametrize("name", sorted(CASES))
def test_where_matches_the_module_tree(name):
    cfg = model_config(dict(TINY, **CASES[name]))
    layout = StackLayout.of(cfg)
    _check_stack(_abstract(cfg).layers, layout)
    if name == "lcm_cycle_plus_one":
        assert (layout.cycle_length, layout.num_cycles, layout.num_blocks) == (6, 1, 1)
        assert layout.where(5) == ("cycles", 5, 0) and layout.where(6) == ("blocks", 0)
    if name == "two_cycles_plus_one":
        assert [layout.where(i) for i in range(5)] == [
            ("cycles", 0, 0), ("cycles", 1, 0), ("cycles", 0, 1), ("cycles", 1, 1), ("blocks", 0)]
    if name in ("less_than_a_cycle", "unscanned"):
        assert layout.num_cycles == 0
        assert [layout.where(i) for i in range(cfg.num_layers)] == [
            ("blocks", i) for i in range(cfg.num_layers)]
    with pytest.raises(IndexError):
        layout.where(cfg.num_layers)


def test_encoder_decoder_stacks_have_their_own_layouts():
    cfg = model_config(dict(TINY, arch="encoder_decoder", num_layers=3, num_encoder_layers=5,
                            layer_pattern=("local", "global")))
    model = _abstract(cfg)
    _check_stack(model.encoder, StackLayout.of(cfg, cfg.encoder_layers))
    _check_stack(model.decoder, StackLayout.of(cfg, cfg.num_layers))
    assert model.encoder.layout.num_cycles == 2 and model.decoder.layout.num_cycles == 1


def _layer_params(model, layout: StackLayout, i: int) -> dict:
    """Layer i's parameters, as {path inside the block: array}."""
    where = layout.where(i)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    if where[0] == "cycles":
        _, j, c = where
        prefix = ("layers", "cycles", "layers", j)
        return {p[len(prefix):]: v.get_value()[c] for p, v in flat.items()
                if p[:len(prefix)] == prefix}
    prefix = ("layers", "blocks", where[1])
    return {p[len(prefix):]: v.get_value() for p, v in flat.items() if p[:len(prefix)] == prefix}


def test_where_is_where_the_layer_computes():
    kw = dict(TINY, num_layers=7, layer_pattern=("local", "global"),
              ffn_pattern=("dense", "dense", "none"))  # cycle lcm(2, 3) = 6, one left over
    scanned = models.build(model_config(kw), rngs=nnx.Rngs(0))
    unrolled = models.build(model_config(dict(kw, scan_layers=False)), rngs=nnx.Rngs(1))
    src, dst = scanned.layers.layout, unrolled.layers.layout
    assert src.num_cycles == 1 and dst.num_cycles == 0
    flat = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    for path, var in flat.items():
        if path[0] != "layers":
            var.set_value(got[path].get_value())  # embedder, final norm
    for i in range(kw["num_layers"]):
        params = _layer_params(scanned, src, i)
        (_, j) = dst.where(i)
        prefix = ("layers", "blocks", j)
        mine = {p[len(prefix):]: v for p, v in flat.items() if p[:len(prefix)] == prefix}
        assert set(mine) == set(params), i
        for p, v in mine.items():
            v.set_value(params[p])
    nnx.update(unrolled, nnx.from_flat_state(flat))
    x = jax.random.randint(jax.random.key(0), (2, 9), 0, 61)
    a = nnx.jit(lambda m, t: m(t))(scanned, x)
    b = nnx.jit(lambda m, t: m(t))(unrolled, x)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(a, jnp.zeros_like(a))
