"""The inference engine against `generate`: greedy tokens equal alone and mixed in ragged
batches, n samples forking a prompt's pages, prefix sharing, reproducible seeds, page
accounting, cancellation and refusals.

Tiny random models; every engine of one model structure shares its compiled programs
(the step shapes, the reset and the fork), so each model compiles them once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import models
from tfjax.config import MeshConfig, model_config
from tfjax.config.run import DEFAULT_RULES
from tfjax.inference import generate
from tfjax.inference.engine import Engine, EngineConfig, PagePool, Request, chain_hashes
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules

TINY = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, d_ff=48, max_len=64,
            init_std=1.0, tie_embeddings=False, num_kv_heads=2)
CONFIG = EngineConfig(max_seqs=4, page_size=4, chunk=5, max_len=40)
# global GQA; a local (ring pages) + global hybrid with sinks; Mamba-2 (a state per row)
MODELS = {"global": {}, "local_global": dict(layer_pattern=("local", "global"),
                                             attention=dict(sliding_window=3, sinks=True)),
          "mamba2_global": dict(layer_pattern=("mamba2", "global"))}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return models.build(model_config({**TINY, **MODELS[request.param]}), rngs=nnx.Rngs(3))


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 61, n).tolist() for n in lengths]


def references(model, prompts, n=16):
    """Each prompt's greedy tokens by `generate`: one batch (rows right-padded to 24
    tokens, so each model compiles it once), `n` tokens a row."""
    ids = np.zeros((len(prompts), 24), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    out = generate(model, jnp.asarray(ids), max_new_tokens=n,
                   prompt_lengths=jnp.asarray([len(p) for p in prompts]))
    return np.asarray(out).tolist()


def reference(model, prompt, n):
    return references(model, [prompt])[0][:n]


def test_greedy_tokens_equal_generate_in_ragged_continuous_batches(model):
    # 6 requests on 4 slots: admitted as slots free up, chunks of 5 beside decode rows
    engine = Engine(model, CONFIG)
    ps = prompts(1, (9, 3, 14, 1, 7, 20))
    reqs = [Request(p, max_tokens=4 + i, sampling=dict(temperature=0)) for i, p in enumerate(ps)]
    got = engine.generate(reqs)
    for r, ref in zip(reqs, references(model, ps)):
        assert got[r.request_id] == [ref[:r.max_tokens]]
    assert engine.pages_in_use() == 0 and not any(engine.slots)


def test_chunks_run_over_the_prefilling_rows_only_in_shapes_warm_up_compiled(model):
    # prefill_rows=2: chunks of 1 or 2 rows (the ragged call's runs beside every row's
    # decode token; Mamba-2: chunk calls, per-row states gathered and put back), of 5
    # tokens or 3 (chunk_sizes=2: a prompt's last piece of 1 .. 3), decode-only calls
    # over 1, 2 or all 4; after warm_up a ragged mix compiles nothing
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=4, chunk=5, max_len=40,
                                        prefill_rows=2, chunk_sizes=2))
    assert engine._row_counts == {3: [1, 2], 5: [1, 2], 1: [1, 2, 4]}
    # and over the first 3, 5 or all 10 pages of the global tables, as the rows fill them
    assert engine._widths == [3, 5, 10]
    engine.warm_up()
    calls, compiles, widths = [], [], set()
    launch, ragged, narrow = engine._launch, engine._launch_ragged, engine._narrow
    engine._launch = lambda group, T: calls.append((len(group), T)) or launch(group, T)
    engine._launch_ragged = lambda prefilling, T, decoding: (
        calls.append((min(len(prefilling), 2), T, "ragged")) or ragged(prefilling, T, decoding))
    engine._narrow = lambda held: widths.add(held) or narrow(held)
    listener = lambda event, secs, **kw: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ps = prompts(9, (12, 3, 17, 1, 8))
        reqs = [Request(p, max_tokens=3 + i, sampling=dict(temperature=0))
                for i, p in enumerate(ps)]
        got = engine.generate(reqs)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for r, ref in zip(reqs, references(model, ps)):
        assert got[r.request_id] == [ref[:r.max_tokens]]
    assert max(c[0] for c in calls if c[1] > 1) == 2 and (3, 1) in calls
    assert min(c[0] for c in calls if c[1] == 1) < 3  # (rows padded to 2 or to 4)
    assert {c[1] for c in calls} == {1, 3, 5}
    assert {len(c) == 3 for c in calls if c[1] > 1} == {engine._ragged}
    assert engine._ragged == ("mamba2" not in model.config.layer_pattern)
    assert {narrow(h) for h in widths} == {((40, 3),), ((40, 5),), ()}
    assert "/jax/core/compile/backend_compile_duration" not in compiles


def test_a_prompt_takes_the_runs_left_in_a_ragged_step(model):
    # two runs of 5 a step (prefill_rows=2): the ragged step gives the first prompt both
    # (17 tokens: 10, then 7 and the second prompt's first 3 would wait for a run);
    # ring pages hold one chunk past their window, so a hybrid with a window takes one
    # run a row, as the chunk calls (Mamba-2) take a chunk a row; tokens as generate's
    engine = Engine(model, dataclasses.replace(CONFIG, prefill_rows=2))
    ps = prompts(4, (17, 6))
    reqs = [Request(p, max_tokens=3, sampling=dict(temperature=0)) for p in ps]
    for r in reqs:
        engine.submit(r)
    outputs = engine.step()
    several = engine._ragged and not engine.rings
    assert [s.computed for s in engine.slots[:2]] == ([10, 0] if several else [5, 5])
    while engine.has_work():
        outputs += engine.step()
    for r, ref in zip(reqs, references(model, ps)):
        assert [o.token for o in outputs if o.request_id == r.request_id] == ref[:3]
    assert engine.pages_in_use() == 0


def test_a_step_is_dispatched_before_the_last_is_read_and_no_sample_is_wasted(model):
    # a decoding row's input token stays on the device, so each step dispatches its
    # calls before reading the step before's; a row is not run past its max_tokens or
    # max_len (30 + 10 = max_len: one more sample would need a page past its table), so
    # every sample dispatched is delivered
    engine = Engine(model, CONFIG)
    events, dispatched = [], []

    def recorded(launch):
        def call(*args):
            out = launch(*args)
            events.append("call")
            dispatched.append(int(np.sum(out[2])))
            return out
        return call

    engine._launch, engine._launch_ragged = map(recorded, (engine._launch,
                                                           engine._launch_ragged))
    finish = engine._finish
    engine._finish = lambda *call: events.append("read") or finish(*call)
    ps = prompts(5, (30, 9, 4))
    reqs = [Request(p, max_tokens=n, sampling=dict(temperature=0))
            for p, n in zip(ps, (10, 6, 3))]
    got = engine.generate(reqs)
    assert [len(got[r.request_id][0]) for r in reqs] == [10, 6, 3]
    assert [got[r.request_id][0] for r in reqs[1:]] == [
        ref[:r.max_tokens] for r, ref in zip(reqs[1:], references(model, ps[1:]))]
    assert sum(dispatched) == 19 and events.count("call") == events.count("read")
    assert events[:2] == ["call", "call"] and engine.pages_in_use() == 0


def test_the_device_tables_are_copies_of_the_host_tables():
    # on CPU a device_put may share a (64-byte aligned) numpy buffer; the host tables
    # change while calls are in flight, so the engine sends copies
    engine = Engine(models.build(model_config(TINY), rngs=nnx.Rngs(3)), CONFIG)
    size, table = next(iter(engine.tables.items()))
    buffer = np.zeros(table.size + 16, np.int32)
    start = (-buffer.ctypes.data % 64) // 4
    engine.tables[size] = aligned = buffer[start:start + table.size].reshape(table.shape)
    engine._tables_on_device = None
    on_device = engine._device_tables()[size]
    aligned[:] = 7
    assert not np.asarray(on_device).any()


MLA = dict(layer_pattern=("mla",), mla=dict(kv_lora_rank=16, q_lora_rank=0, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=8))


def test_the_ragged_step_serves_paged_layers_only():
    # K/V pages and MLA's latent pages are read once a run (`Paged.runs`); a recurrent
    # state is per row: it keeps the two calls; `ragged=False` forces them
    for extra, ragged in [({}, True), (MLA, True), (MODELS["mamba2_global"], False),
                          (MODELS["local_global"], True)]:
        model = models.build(model_config({**TINY, **extra}), rngs=nnx.Rngs(3))
        assert Engine(model, CONFIG)._ragged is ragged
    assert Engine(model, dataclasses.replace(CONFIG, ragged=False))._ragged is False


def test_mla_tokens_equal_generate_in_ragged_steps_of_several_runs():
    # the absorbed form over each run's latent pages (`paged.split_runs`), beside
    # decode rows; the prompt of 20 takes the first step's 4 runs of 5
    model = models.build(model_config({**TINY, **MLA}), rngs=nnx.Rngs(3))
    engine = Engine(model, dataclasses.replace(CONFIG, table_widths=1))  # (fewer compiles)
    calls, ragged = [], engine._launch_ragged
    engine._launch_ragged = lambda prefilling, C, decoding: (
        calls.append(C) or ragged(prefilling, C, decoding))
    ps = prompts(1, (20, 3, 14, 1, 7, 9))
    reqs = [Request(p, max_tokens=4 + i, sampling=dict(temperature=0)) for i, p in enumerate(ps)]
    got = engine.generate(reqs)
    for r, ref in zip(reqs, references(model, ps)):
        assert got[r.request_id] == [ref[:r.max_tokens]]
    assert calls and engine.pages_in_use() == 0


@pytest.mark.slow  # ~45 s each: every program compiled for an 8-device mesh
@pytest.mark.parametrize("kind", ["mamba2_global", "global"])
def test_under_a_mesh_nothing_compiles_after_warm_up_and_tokens_stay(kind):
    # the state is placed as every program returns it: a new input sharding would
    # compile the reset, step and fork again on their second and third use (Mamba-2:
    # the chunk and decode calls; global: the ragged step, its token rows sharded)
    model = models.build(model_config({**TINY, **MODELS[kind]}), rngs=nnx.Rngs(3))
    mesh = make_mesh(MeshConfig(data=2, tensor=2, fsdp=2))
    engine = Engine(model, CONFIG, mesh=mesh, rules=logical_rules(DEFAULT_RULES))
    engine.warm_up()
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event)  # noqa: E731
    ps = prompts(10, (9, 3, 14))
    got = []
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(2):
            reqs = [Request(p, max_tokens=4, n=2 if i == 0 else 1,
                            sampling=dict(temperature=0)) for i, p in enumerate(ps)]
            got.append(list(engine.generate(reqs).values()))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "/jax/core/compile/backend_compile_duration" not in compiles
    refs = references(model, ps)
    assert got[0] == got[1] == [[ref[:4]] * (2 if i == 0 else 1) for i, ref in enumerate(refs)]


def test_n_samples_fork_the_prompt_and_seeds_reproduce_whatever_the_batch(model):
    engine = Engine(model, CONFIG)
    # prefix pages are shared only where every cached layer keeps global K/V
    assert engine.shareable == (model.config.layer_pattern == ("global",))
    p = prompts(2, (11,))[0]
    hot = dict(temperature=1.5, seed=7)
    many = engine.generate([Request(p, max_tokens=6, n=3, sampling=hot)])
    (samples,) = many.values()
    assert len({tuple(s) for s in samples}) > 1  # different draws
    alone = engine.generate([Request(p, max_tokens=6, sampling=hot)])
    assert list(alone.values())[0][0] == samples[0]  # sample 0 keeps the request's seed
    # the same request among others, in another slot, gives the same tokens
    others = [Request(q, max_tokens=5, sampling=dict(temperature=1.0, seed=i))
              for i, q in enumerate(prompts(3, (4, 13)))]
    mixed = engine.generate(others + [Request(p, max_tokens=6, sampling=hot)])
    assert list(mixed.values())[-1][0] == samples[0]
    assert engine.pages_in_use() == 0


def test_greedy_samples_of_a_fork_equal_generate(model):
    engine = Engine(model, CONFIG)
    p = prompts(4, (10,))[0]
    (samples,) = engine.generate([Request(p, max_tokens=5, n=2,
                                          sampling=dict(temperature=0))]).values()
    assert samples == [reference(model, p, 5)] * 2


def test_prefix_pages_are_shared_and_kept_for_later_prompts():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, CONFIG)
    assert engine.shareable
    p = prompts(5, (14,))[0]
    first = engine.generate([Request(p, max_tokens=3, sampling=dict(temperature=0))])
    pool = engine.pools[engine.global_size]
    assert pool.held == 0 and pool.available == pool.num_pages - 1  # cached pages reusable
    engine.submit(Request(p + [5], max_tokens=3, sampling=dict(temperature=0)))
    engine._drain(), engine._admit()
    seq = next(s for s in engine.slots if s is not None)
    assert seq.computed == 12  # three full pages of the 14 earlier tokens, not computed again
    out = []
    while engine.has_work():
        out += [o.token for o in engine.step()]
    assert list(first.values())[0][0] == reference(model, p, 3)
    assert out == reference(model, p + [5], 3)


def test_a_small_pool_admits_requests_as_pages_free_up():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=4, chunk=5, max_len=40,
                                        num_pages=12, prefix_caching=False))
    ps = prompts(6, (12, 9, 15, 6))
    reqs = [Request(p, max_tokens=8, sampling=dict(temperature=0)) for p in ps]
    got = engine.generate(reqs)
    for r, ref in zip(reqs, references(model, ps)):
        assert got[r.request_id] == [ref[:8]]
    assert engine.pages_in_use() == 0


def test_stops_and_cancellation_free_pages():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    p = prompts(7, (8,))[0]
    ref = reference(model, p, 6)
    engine = Engine(model, CONFIG, eos_ids=(ref[2],))
    got = engine.generate([Request(p, max_tokens=6, sampling=dict(temperature=0))])
    assert list(got.values())[0][0] == ref[:ref.index(ref[2]) + 1]  # up to and with EOS
    got = engine.generate([Request(p, max_tokens=6, stop_token_ids=[ref[3]], ignore_eos=True,
                                   sampling=dict(temperature=0))])
    assert list(got.values())[0][0] == ref[:ref.index(ref[3]) + 1]
    rid = engine.submit(Request(p, max_tokens=30, ignore_eos=True, sampling=dict(temperature=0)))
    engine.step(), engine.step()
    assert engine.pages_in_use() > 0
    engine.cancel(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"] and engine.pages_in_use() == 0
    assert not engine.has_work()


def test_queued_counts_requests_until_admitted_and_a_cancelled_fork_frees_its_slots():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, EngineConfig(max_seqs=2, page_size=4, chunk=5, max_len=40))
    assert engine.queued() == 0
    p = prompts(8, (14,))[0]
    first = engine.submit(Request(p, max_tokens=8, n=2, sampling=dict(temperature=1.0)))
    engine.submit(Request(p, max_tokens=8, sampling=dict(temperature=0)))
    assert engine.queued() == 2
    engine.step()  # the first request takes both slots and prefills a chunk
    assert engine.queued() == 1 and engine.pages_in_use() > 0
    engine.cancel(first)  # before its fork: the follower's slot is a placeholder
    engine.step()
    assert engine.queued() == 0  # the second request got the freed slots
    while engine.has_work():
        engine.step()
    assert engine.pages_in_use() == 0 and not any(engine.slots)


def test_a_request_larger_than_the_pool_is_refused_at_submission():
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, EngineConfig(max_seqs=4, page_size=4, chunk=5, max_len=40,
                                        num_pages=12))
    engine.submit(Request([1] * 8, max_tokens=32))  # 10 pages: fits in 11
    with pytest.raises(ValueError, match=r"^max_tokens: 3 sample\(s\) .* need 28 pages, the "
                       r"pool has 11; lower max_tokens or n") as e:
        engine.submit(Request([1] * 8, max_tokens=32, n=3))
    assert "\n" not in str(e.value)


def test_pool_reference_counts_and_prefix_chain():
    pool = PagePool(4)
    a, b = pool.allocate(), pool.allocate()
    assert 0 not in (a, b) and pool.available == 1
    pool.retain(a)
    pool.release([a])
    assert pool.refs[a] == 1
    keys = chain_hashes(list(range(8)), 4)
    assert keys != chain_hashes([1] + list(range(1, 8)), 4)[:1] + keys[1:]  # a chain
    pool.register(keys[0], a)
    pool.release([a, b])
    assert pool.available == 3 and pool.lookup(keys) == [a]  # kept, not free
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])


@pytest.mark.parametrize("kw, match", [
    (dict(prompt=[]), "prompt: empty"),
    (dict(prompt=[99]), "outside the vocabulary"),
    (dict(prompt=[1] * 40), "leave no room"),
    (dict(prompt=[1], max_tokens=0), "max_tokens"),
    (dict(prompt=[1], n=5), "max_seqs"),
    (dict(prompt=[1], logprobs=21), "logprobs"),
    (dict(prompt=[1], sampling=dict(temperature=-1)), "temperature"),
    (dict(prompt=[1], sampling=dict(top_p=0)), "top_p"),
    (dict(prompt=[1, 2], score_from=1, max_tokens=0, n=2), "one sample"),
    (dict(prompt=[1, 2], score_from=2), "score_from"),
    (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
])
def test_bad_requests_are_refused_in_one_line(kw, match):
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, CONFIG)
    with pytest.raises(ValueError, match=match) as e:
        engine.submit(Request(**kw))
    assert "\n" not in str(e.value)


def test_scored_prompts_give_the_forward_log_probabilities_with_shared_contexts():
    # lm-eval's loglikelihood: contexts shared by several continuations (prefix pages)
    model = models.build(model_config(TINY), rngs=nnx.Rngs(3))
    engine = Engine(model, CONFIG)
    context = prompts(8, (13,))[0]
    reqs = [Request(context + cont, max_tokens=0, score_from=len(context))
            for cont in prompts(9, (3, 1, 6))]
    reqs.append(Request(context + [7, 8], max_tokens=2, score_from=len(context),
                        sampling=dict(temperature=0)))
    for r in reqs:
        engine.submit(r)
    got = {}
    while engine.has_work():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = (o.prompt_logprobs, o.prompt_greedy)
    for r in reqs:
        p = np.asarray(r.prompt)
        logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(p[None])))[0]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                keepdims=True)) \
            - logits.max(-1, keepdims=True)
        k = len(context)
        want = logp[np.arange(k - 1, len(p) - 1), p[k:]]
        np.testing.assert_allclose(got[r.request_id][0], want, rtol=1e-4, atol=1e-4)
        assert got[r.request_id][1] == list(logits[k - 1:len(p) - 1].argmax(-1) == p[k:])
    assert engine.pages_in_use() == 0
