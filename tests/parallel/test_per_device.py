"""The per-device runner (`tfjax.parallel.per_device.batch_sharded_attention`): an
implementation XLA cannot partition (the Pallas kernels, interpret mode here) under
an active mesh runs once per device on its own examples and heads, with the values
and gradients of the unmeshed call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import tfjax.ops.pallas as pallas_lib
from tfjax import models
from tfjax.config import DEFAULT_RULES, MeshConfig, model_config
from tfjax.ops import RelativeBias, dot_product_attention, masks, target
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, tree_shardings
from tfjax.parallel.sharding import use_rules

N, K, H = 8, 2, 16  # GQA 8/2


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])


def test_pallas_under_a_mesh_runs_per_device_on_its_own_examples(monkeypatch):
    """dot_product_attention(implementation="pallas") under an active mesh (as the
    trainer traces its step): the kernels are custom calls XLA cannot partition, so
    the dispatch runs them in shard_map over the batch axes (`batch_sharded_attention`)
    instead of letting XLA gather the global batch onto every device. Same values and
    gradients (q, k, v, T5's table) as without a mesh, with segments, ALiBi at
    explicit positions, T5's bias, a traced q offset and the logsumexp; no all-gather
    in the compiled program; nothing to split (B not divisible) runs unwrapped.
    Heads split too where "heads" maps to a mesh axis dividing the query and kv heads
    (ALiBi's slopes and T5's table split with them)."""
    seen = []  # (examples, query heads, kv heads) of each kernel call
    kernel = pallas_lib.flash_attention
    monkeypatch.setattr(pallas_lib, "flash_attention", lambda q, k, *a, **kw: seen.append(
        (q.shape[0], q.shape[2], k.shape[2])) or kernel(q, k, *a, **kw))

    mesh = _mesh((4, 2), ("data", "tensor"))
    Bm, Tm = 4, 40
    ks = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(ks[0], (Bm, Tm, N, H), jnp.float32)
    k, v = (jax.random.normal(x, (Bm, Tm, K, H), jnp.float32) for x in ks[1:3])
    seg = np.sort(np.random.default_rng(0).integers(0, 3, (Bm, Tm)), axis=1).astype(np.int32)
    pos = np.tile(np.arange(Tm, dtype=np.int32) * 2, (Bm, 1))
    table = jax.random.normal(ks[3], (32, N))
    slopes = jnp.linspace(0.5, 0.05, N)
    def run(q, k, v, table, qo):
        rb = RelativeBias(table, bidirectional=False, q_positions=pos, kv_positions=pos)
        out, lse = dot_product_attention(
            q, k, v, masks.causal() & masks.segments(seg), relative_bias=rb,
            alibi_slopes=slopes, alibi_positions=(pos, pos), q_offset=qo,
            implementation="pallas", return_lse=True)
        return (out.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()), out

    grad = jax.grad(run, (0, 1, 2, 3), has_aux=True)
    want_g, want = jax.jit(grad)(q, k, v, table, jnp.int32(2))
    assert set(seen) == {(Bm, N, K)}
    seen.clear()

    def under_mesh(*a):
        with use_rules(mesh, [("batch", "data"), ("heads", "tensor")]):
            return grad(*a)

    f = jax.jit(under_mesh)
    got_g, got = f(q, k, v, table, jnp.int32(2))
    # one example per device of "data", half the heads (whole GQA groups) per "tensor"
    assert set(seen) == {(Bm // 4, N // 2, K // 2)}, seen
    np.testing.assert_allclose(got, want, atol=2e-5)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(g, w, atol=1e-4)
    hlo = f.lower(q, k, v, table, jnp.int32(2)).compile().as_text()
    assert "all-gather" not in hlo
    # a bias array [1, N, T, S] (per head, shared by the examples) splits by heads
    bias = jax.random.normal(ks[4], (1, N, Tm, Tm))
    attn = lambda q, k, v, bias: dot_product_attention(q, k, v, masks.causal(), bias=bias,
                                                       implementation="pallas")

    def biased(*a):
        with use_rules(mesh, [("batch", "data"), ("heads", "tensor")]):
            return attn(*a)

    np.testing.assert_allclose(jax.jit(biased)(q, k, v, bias), attn(q, k, v, bias), atol=2e-5)
    with use_rules(mesh, [("batch", "data")]):  # the runner use_rules gives the ops
        assert target.per_device()(lambda *a, **k: 0, q[:3], k[:3], v[:3], None) is None


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_pallas_heads_split_when_the_tensor_axis_does_not_divide_the_kv_heads(
        monkeypatch, kv_heads):
    """MQA (1 kv head) and GQA 8/2 on data=2 x tensor=4: the tensor axis divides the 8
    query heads but not the kv heads, so `batch_sharded_attention` repeats each kv
    head until every device holds the one its 2 query heads read (instead of running
    all 8 heads on every tensor device). Values and q/k/v gradients (the copies'
    gradients summed back) equal the unmeshed call, with ALiBi splitting by heads."""
    seen = []
    kernel = pallas_lib.flash_attention
    monkeypatch.setattr(pallas_lib, "flash_attention", lambda q, k, *a, **kw: seen.append(
        (q.shape[0], q.shape[2], k.shape[2])) or kernel(q, k, *a, **kw))
    mesh = _mesh((2, 4), ("data", "tensor"))
    ks = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ks[0], (2, 24, N, H), jnp.float32)
    k, v = (jax.random.normal(x, (2, 24, kv_heads, H), jnp.float32) for x in ks[1:3])
    w = jax.random.normal(ks[3], q.shape)
    slopes = jnp.linspace(0.5, 0.05, N)
    loss = lambda q, k, v: (w * dot_product_attention(
        q, k, v, masks.causal(), alibi_slopes=slopes, implementation="pallas")).sum()
    grad = jax.value_and_grad(loss, (0, 1, 2))
    want_l, want_g = grad(q, k, v)

    def under_mesh(*a):
        with use_rules(mesh, [("batch", "data"), ("heads", "tensor"),
                              ("kv_heads", "tensor")]):
            return grad(*a)

    seen.clear()
    got_l, got_g = jax.jit(under_mesh)(q, k, v)
    assert set(seen) == {(1, N // 4, 1)}, seen
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for g, want in zip(got_g, want_g):
        np.testing.assert_allclose(g, want, atol=1e-4)


def test_a_model_with_pallas_attention_on_a_data_tensor_mesh_equals_one_device(monkeypatch):
    """The decoder with attention_impl="pallas" (interpret kernels) on a data=2 x
    tensor=2 mesh under the default rules: each kernel call gets its device's 2
    examples, 2 of 4 query heads and 1 of 2 kv heads, and the loss and every
    parameter gradient equal one device's."""
    seen = []
    kernel = pallas_lib.flash_attention
    monkeypatch.setattr(pallas_lib, "flash_attention", lambda q, k, *a, **kw: seen.append(
        (q.shape[0], q.shape[2], k.shape[2])) or kernel(q, k, *a, **kw))
    cfg = model_config(dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=48, max_len=64, init_std=1.0,
                            attention=dict(impl="pallas")))
    model = models.build(cfg, rngs=nnx.Rngs(3))
    x = jax.random.randint(jax.random.key(0), (4, 24), 0, 61)
    loss = lambda m, x: m(x).astype(jnp.float32).mean()
    want_l, want_g = nnx.value_and_grad(loss)(model, x)
    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    rules = logical_rules(DEFAULT_RULES)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, tree_shardings(state, mesh, rules)))
    seen.clear()

    @nnx.jit
    def sharded(m, x):
        with use_rules(mesh, rules):
            return nnx.value_and_grad(loss)(m, x)

    got_l, got_g = sharded(model, x)
    assert set(seen) == {(2, 2, 1)}, seen
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    # fp32 sums split across the tensor axis round differently from one device's, and
    # from one CPU's vector width to another's (init_std=1 makes large logits): up to
    # 7e-5 of a leaf's largest entry seen (an absolute 2e-5 held on one machine and
    # failed on the next); a wrong head split errs by the order of the entries
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, atol=5e-4 * float(jnp.max(jnp.abs(b)))), nnx.state(got_g), nnx.state(want_g))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_paged_kernel_under_a_mesh_runs_per_device_on_its_rows(monkeypatch, kv_heads):
    """Paged k/v (the paged TPU kernel, interpreted) through the per-device runner on
    data=4 x tensor=2: every device holds every page (pages belong to no row), the
    page tables and the mask split with the rows; the heads split where the tensor
    axis divides the kv heads, else they stay whole (repeating a pool's kv heads
    would copy the pool). The values equal the unmeshed call's."""
    from tfjax.ops.paged import Paged
    from tfjax.ops.pallas import paged_tpu

    seen = []  # (rows, query heads, pages, kv heads, table rows) of each kernel call
    kernel = paged_tpu.paged_attention_tpu
    monkeypatch.setattr(paged_tpu, "paged_attention_tpu", lambda q, k, *a, **kw: seen.append(
        (q.shape[0], q.shape[2], *k.pool.shape[0:3:2], k.table.shape[0])) or kernel(q, k, *a, **kw))
    mesh = _mesh((4, 2), ("data", "tensor"))
    B, T, page, n, pages = 4, 2, 3, 4, 19
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k_pool, v_pool = (jax.random.normal(x, (pages, page, kv_heads, H)) for x in ks[1:])
    table = np.random.default_rng(0).permutation(pages)[:B * n].reshape(B, n).astype(np.int32)
    length = np.array([5, 12, 0, 7])
    q_pos = (length[:, None] - T + np.arange(T)).astype(np.int32)
    kv_pos = np.where(np.arange(n * page) < length[:, None], np.arange(n * page), -1)
    mask = masks.positions(q_pos, kv_pos.astype(np.int32))

    def attend(q, k_pool, v_pool):
        return dot_product_attention(q, Paged(k_pool, table), Paged(v_pool, table), mask,
                                     implementation="paged_tpu")

    want = jax.jit(attend)(q, k_pool, v_pool)
    seen.clear()

    def under_mesh(*a):
        with use_rules(mesh, [("batch", "data"), ("heads", "tensor")]):
            return attend(*a)

    got = jax.jit(under_mesh)(q, k_pool, v_pool)
    split = kv_heads % 2 == 0
    assert set(seen) == {(1, N // 2 if split else N, pages, kv_heads // 2 if split else kv_heads,
                          1)}, seen
    np.testing.assert_allclose(got, want, atol=2e-5)
