"""Generation on a (data=2, tensor=2) mesh of simulated CPU devices equals one device,
and the caches are sharded: rows over "data", kv heads over "tensor"."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax import models
from tfjax.config import DEFAULT_RULES, MeshConfig, model_config
from tfjax.inference import generate
from tfjax.inference.generate import _prepare, _programs
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import use_rules


def test_sharded_generation_equals_one_device():
    cfg = model_config(dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=48, max_len=64, init_std=1.0,
                            tie_embeddings=False, norm="rmsnorm"))
    model = models.build(cfg, rngs=nnx.Rngs(3))
    x = jax.random.randint(jax.random.key(0), (2, 6), 0, 61)
    lengths = jnp.array([6, 3])
    want = np.asarray(generate(model, x, max_new_tokens=8, prompt_lengths=lengths))

    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    rules = logical_rules(DEFAULT_RULES)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tree_shardings(state, mesh, rules)))
    with use_rules(mesh, rules):
        got = np.asarray(generate(model, x, max_new_tokens=8, prompt_lengths=lengths))
        graphdef, st, prompt, lens, settings, cache_len, *_ , key = _prepare(
            model, x, 8, lengths, 0.0, None, None, None, None, 0)
        _, cache = _programs(graphdef, mesh)[0](st, prompt, lens, key, settings,
                                                cache_len=cache_len, decoder_start_id=0)
    np.testing.assert_array_equal(got, want)
    k = cache.layers["cycles"][0]["attn"].k  # [cycles, B, K, S, H]
    spec = tuple(k.sharding.spec) + (None,) * (k.ndim - len(k.sharding.spec))
    assert "data" in np.atleast_1d(spec[1]).tolist() and spec[2] == "tensor", spec
