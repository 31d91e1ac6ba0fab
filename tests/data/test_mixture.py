"""The cache mixture (`tfjax.data.mixture`): rows against a plain cut of each stream and
against `PackedBatches`, exact per-block counts, shares, random access across stages,
each process reading its own rows, the data_tokens count, the validation pass, and the
config errors (on the in-memory cache double of tests/data/token_caches.py)."""

import numpy as np
import pytest
from token_caches import MemoryCache, memory_caches

from tfjax import config as C
from tfjax.data import ByteTokenizer, PackedBatches
from tfjax.data import mixture
from tfjax.data.mixture import MixtureBatches, MixturePlan, block_counts, check_caches, open_caches
from tfjax.data.pipeline import BATCH_KEYS

TOK = ByteTokenizer()


def docs(seed, n, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 256, rng.integers(lo, hi))) for _ in range(n)]


def caches(*sizes, seq=0):
    return [MemoryCache(docs(seq + i, n), TOK, path=f"mem/c{i}") for i, n in enumerate(sizes)]


def reference_row(cache, i, T):
    """Row i cut from the whole stream by a plain loop: pieces split where the document
    changes, positions from 0 per piece, mask 0 across pieces and on padding."""
    ids, doc = cache._stream[:, i * T: i * T + T + 1]
    toks, seg, pos = [], [], []
    for k in range(T + 1):
        if k < len(ids):
            new = k == 0 or doc[k] != doc[k - 1]
            seg.append(1 if k == 0 else seg[-1] + new)
            pos.append(0 if new else pos[-1] + 1)
            toks.append(ids[k])
        else:
            toks.append(TOK.pad_id), seg.append(0), pos.append(0)
    mask = [int(seg[k] == seg[k + 1] and seg[k] > 0) for k in range(T)]
    return dict(inputs=toks[:T], targets=toks[1:], positions=pos[:T], segment_ids=seg[:T],
                mask=mask, target_bytes=[int(t < 256) * m for t, m in zip(toks[1:], mask)])


def take(it, n):
    return [next(it) for _ in range(n)]


def test_block_counts_are_exact_largest_remainders():
    assert block_counts((1, 1, 1), 10) == (4, 3, 3)  # ties go to the earlier source
    assert block_counts((0.5, 0.3, 0.2), 7) == (4, 2, 1)  # 3.5, 2.1, 1.4 -> remainders .5, .4
    assert block_counts((0, 2), 5) == (0, 5)
    assert block_counts((1e-6, 1), 2048) == (0, 2048)
    for w, n in [((3, 1, 7, 0.5), 2048), ((1,) * 7, 3), ((0.1, 0.2), 1)]:
        assert sum(block_counts(w, n)) == n
    for bad in [(), (1, -1), (0, 0), (float("nan"), 1)]:
        with pytest.raises(ValueError, match="data.weights"):
            block_counts(bad, 8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_rows_are_the_streams_cut_in_rows(shuffle):
    cs, T = caches(9, 14), 16
    it = MixtureBatches(cs, TOK, seq_len=T, global_batch=4, weights=(1, 2), block_rows=6,
                        shuffle=shuffle, seed=3)
    for step, b in enumerate(take(it, 12)):
        for r in range(4):
            s, i = it.plan.source_row(step, r)
            assert 0 <= i < (cs[s].stream_length - 1) // T
            want = reference_row(cs[s], i, T)
            for k in BATCH_KEYS:
                np.testing.assert_array_equal(b[k][r], want[k], err_msg=f"{k} step {step} row {r}")
            assert b[k].dtype == np.int32


def test_one_source_in_order_is_packed_batches():
    texts = [bytes(d) for d in docs(5, 12)]  # PackedBatches takes any list of documents
    ids = [list(TOK.encode(t)) for t in texts]
    cache = MemoryCache(ids, TOK)
    T = 13
    rows = (cache.stream_length - 1) // T
    mix = MixtureBatches([cache], TOK, seq_len=T, global_batch=1, shuffle=False)
    packed = PackedBatches(texts, TOK, seq_len=T, global_batch=1, shuffle=False)
    for a, b in zip(take(mix, rows), take(packed, rows)):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("held", [True, False], ids=["permutation", "index_shuffle"])
def test_every_pass_reads_each_row_once_in_a_fresh_order(held, monkeypatch):
    # a pass's permutation held in memory, or grain's index shuffle for larger sources
    monkeypatch.setattr(mixture, "PERMUTED_ROWS", 1 << 22 if held else 3)
    # 1 draw a block from each: each source's draws come in their order (its passes)
    plan = MixturePlan([6, 4], [(0, (1, 1))], global_batch=2, block_rows=2, seed=1)
    draws = {0: [], 1: []}
    for step in range(24):
        for r in range(2):
            s, i = plan.source_row(step, r)
            draws[s].append(i)
    for s, n in enumerate([6, 4]):
        passes = [draws[s][p * n:(p + 1) * n] for p in range(len(draws[s]) // n)]
        assert len(passes) >= 3
        assert all(sorted(p) == list(range(n)) for p in passes)
        assert len({tuple(p) for p in passes}) > 1  # a fresh permutation each pass


def test_each_block_takes_its_computed_counts():
    weights, block, B = (3, 1, 2), 10, 4
    plan = MixturePlan([50, 50, 50], [(0, weights)], global_batch=B, block_rows=block, seed=7)
    src = [plan.source_row(step, r)[0] for step in range(40) for r in range(B)]
    for b in range(len(src) // block):
        got = np.bincount(src[b * block:(b + 1) * block], minlength=3)
        assert tuple(got) == block_counts(weights, block) == (5, 2, 3)
    assert src[:block] != sorted(src[:block])  # placed in a seeded order


def test_realised_share_follows_the_weights():
    weights = (0.6, 0.3, 0.1)
    plan = MixturePlan([1000] * 3, [(0, weights)], global_batch=16, block_rows=64, seed=2)
    share = plan.draws(400) / (400 * 16)
    np.testing.assert_allclose(share, weights, atol=1 / 64)


def test_random_access_and_resume_across_stages():
    cs = caches(8, 8, 8)
    kw = dict(seq_len=8, global_batch=4, weights=(1, 0, 1), stages=((5, (0, 1, 0)), (9, (1, 1, 1))),
              block_rows=6, seed=11)
    full = take(MixtureBatches(cs, TOK, **kw), 14)
    for s in (0, 3, 5, 7, 9, 12):
        it = MixtureBatches(cs, TOK, **kw)
        it.set_state(dict(batch=s))
        for a, b in zip(take(it, 14 - s), full[s:]):
            for k in BATCH_KEYS:
                np.testing.assert_array_equal(a[k], b[k])
    plan = MixtureBatches(cs, TOK, **kw).plan
    stage1 = {plan.source_row(step, r)[0] for step in range(5, 9) for r in range(4)}
    assert stage1 == {1}  # stage (0, 1, 0) draws from cache 1 alone
    assert {plan.source_row(step, r)[0] for step in range(5) for r in range(4)} == {0, 2}


def test_process_rows_partition_the_batch_and_read_only_their_rows():
    cs = caches(10, 12)
    kw = dict(seq_len=8, global_batch=6, weights=(1, 1), block_rows=4, seed=5)
    full = take(MixtureBatches(cs, TOK, **kw), 5)
    for c in cs:
        c.reads.clear()
    halves = [take(MixtureBatches(cs, TOK, local_rows=rows, **kw), 5)
              for rows in ([0, 1, 2], [3, 4, 5])]
    plan = MixtureBatches(cs, TOK, **kw).plan
    for step in range(5):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(
                np.concatenate([halves[0][step][k], halves[1][step][k]]), full[step][k])
    want = sorted((s, i * 8) for step in range(5) for r in range(6)
                  for s, i in [plan.source_row(step, r)])
    got = sorted((s, start) for s, c in enumerate(cs) for start, stop in c.reads)
    assert got == want  # one read a row, of its own rows only
    assert all(stop - start == 9 for c in cs for start, stop in c.reads)


def test_data_tokens_count_the_rows_read():
    cs = caches(9, 9, 9)
    it = MixtureBatches(cs, TOK, seq_len=8, global_batch=3, weights=(2, 1, 1),
                        stages=((4, (0, 1, 3)),), block_rows=5, seed=1)
    assert it.data_tokens(0) == {f"data_tokens/c{i}": 0 for i in range(3)}
    for step in range(1, 11):
        next(it)
        counted = {f"data_tokens/{c.name}": len(c.reads) * 8 for c in cs}
        assert it.data_tokens(step) == counted, step


def test_validation_pass_reads_every_row_once_in_order():
    cs, T, B = caches(3, 5), 8, 4
    rows = [-(-(c.stream_length - 1) // T) for c in cs]
    it = MixtureBatches(cs, TOK, seq_len=T, global_batch=B, repeat=False)
    n = it.num_batches()
    assert n == -(-sum(rows) // B)
    got = [b for b in it]
    assert len(got) == n
    flat = {k: np.concatenate([b[k] for b in got]) for k in BATCH_KEYS}
    order = [(c, i) for c, m in zip(cs, rows) for i in range(m)]
    for g, (c, i) in enumerate(order):
        want = reference_row(c, i, T)
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(flat[k][g], want[k])
    assert flat["mask"][len(order):].sum() == 0  # the batch's rest is padding
    scored = flat["mask"].sum()
    assert scored == sum(c.stream_length - 1 - (c.num_documents - 1) for c in cs)
    assert it.data_tokens(3) == {}


def test_state_is_the_batch_counter_and_checked():
    it = MixtureBatches(caches(4), TOK, seq_len=8, global_batch=2)
    take(it, 3)
    assert it.get_state() == dict(batch=3)
    for bad in [dict(batch=-1), dict(batch="3"), dict(cursors=[[0, 0]], batch=1), {}]:
        with pytest.raises(ValueError, match="not a cache mixture's batch counter"):
            it.set_state(bad)


def test_a_cache_shorter_than_one_row_is_refused():
    small = MemoryCache([[1, 2]], TOK, path="mem/small")
    with pytest.raises(ValueError, match="data.paths: mem/small holds 4 tokens, fewer than one "
                                         "row of seq_len \\+ 1 = 9"):
        MixtureBatches([small], TOK, seq_len=8, global_batch=2)


def data(paths, **kw):
    return C.from_dict(C.DataConfig, dict(source="cache", paths=paths, **kw))


def test_open_caches_errors(monkeypatch):
    one = dict(train=docs(0, 3), validation=docs(1, 2))
    memory_caches(monkeypatch, TOK, {"x/a": one, "y/a": one, "z/b": dict(train=docs(2, 3))})
    assert [c.name for c in open_caches(data(("x/a", "z/b")), "train")] == ["a", "b"]
    assert [c.path for c in open_caches(data(("x/a", "z/b")), "validation")] == ["x/a"]
    with pytest.raises(ValueError, match=r"data.paths\[1\]: nope: no metadata.json"):
        open_caches(data(("x/a", "nope")), "train")
    with pytest.raises(ValueError, match="two caches share the directory name 'a'"):
        open_caches(data(("x/a", "y/a")), "train")
    with pytest.raises(ValueError, match=r"data.paths: no cache has a validation split "
                                         r"\(data.paths\[0\]: z/b: the validation split is empty"):
        open_caches(data(("z/b",)), "validation")
    memory_caches(monkeypatch, TOK, {"e": dict(train=[])})
    with pytest.raises(ValueError, match=r"data.paths\[0\]: e: the train split is empty"):
        open_caches(data(("e",)), "train")


def test_a_cache_of_another_tokenizer_is_refused():
    other = MemoryCache(docs(0, 3), TOK, path="mem/gpt", tokenizer_name="gpt2.json",
                        fingerprint="f" * 64)
    check_caches(caches(2), TOK, "byte")
    with pytest.raises(ValueError, match="data.paths: mem/gpt was prepared with tokenizer "
                                         "'gpt2.json', but data.tokenizer='byte' encodes "
                                         "differently"):
        check_caches([*caches(2), other], TOK, "byte")


@pytest.mark.parametrize("values,message", [
    (dict(source="cache"), "data.paths: data.source='cache' needs prepared cache directories"),
    (dict(paths=("a", "b"), weights=(1,)), r"data.weights: 1 weight\(s\) for 2 cache"),
    (dict(paths=("a", "b"), weights=(1, -1)), "data.weights: .* negative or non-finite"),
    (dict(paths=("a", "b"), weights=(0, 0)), "data.weights: .* sums to zero"),
    (dict(paths=("a",), stages=((0, (1,)),)), r"data.stages\[0\]: starts at step 0, not after step 0"),
    (dict(paths=("a",), stages=((5, (1,)), (5, (2,)))),
     r"data.stages\[1\]: starts at step 5, not after the previous stage \(step 5\)"),
    (dict(paths=("a", "b"), stages=((5, (1,)),)), r"data.stages\[0\]: 1 weight\(s\) for 2"),
    (dict(paths=("a",), stages=((5, (0,)),)), r"data.stages\[0\]: .* sums to zero"),
    (dict(paths=("a",), stages=((5,),)), r"data.stages\[0\]: expected 2 items"),
    (dict(paths=("a",), block_rows=0), "data.block_rows: must be > 0"),
    (dict(paths=("a",), val_paths=("b",)), "data.val_paths: a cache holds its own validation"),
])
def test_cache_config_errors(values, message):
    with pytest.raises(ValueError, match=message):
        C.from_dict(C.RunConfig, dict(data=dict(dict(source="cache"), **values))).validate()


def test_weights_belong_to_caches():
    for field in ("weights", "stages"):
        value = (1.0,) if field == "weights" else ((3, (1.0,)),)
        with pytest.raises(ValueError, match=f"data.{field}: mixes token caches, but "
                                             f"data.source='text'"):
            C.from_dict(C.RunConfig, dict(data=dict(source="text", paths=("a",),
                                                    **{field: value}))).validate()
