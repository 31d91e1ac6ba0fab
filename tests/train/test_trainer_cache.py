"""The trainer on a cache mixture (`data.source="cache"`): every record carries
data_tokens/<cache>, resume across a change of stage is exact, a cache of another
tokenizer or an objective that cannot read caches fails before compiling.

The caches are real (`tfjax.data.prepare`, tests/data/token_caches.py), but for the
tokenizer check, which gives the in-memory stand-in another tokenizer's fingerprint."""

import json
import os
import sys

import numpy as np
import pytest
import tiny_decoder
from tiny_setup import devices, preempt_after, tiny_config

from tfjax.data import ByteTokenizer
from tfjax.data.cache import TokenCache
from tfjax.train import Trainer
from tfjax.train.objectives import OBJECTIVES, check_objective

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "data"))
from token_caches import memory_caches, prepared_cache  # noqa: E402

TOK = ByteTokenizer()


def corpus(seed, n):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(97, 123, rng.integers(5, 60))) for _ in range(n)]


@pytest.fixture
def caches(monkeypatch, tmp_path):
    """Two prepared caches, "web" and "code"; `reads[path]`: the spans read from each
    cache's train split."""
    paths = (prepared_cache(tmp_path / "web", dict(train=corpus(0, 40), validation=corpus(1, 4))),
             prepared_cache(tmp_path / "code", dict(train=corpus(2, 30), validation=corpus(3, 3))))
    reads = {p: [] for p in paths}
    read = TokenCache.read

    def counted(self, start, stop):
        if self.split == "train":
            reads[self.path].append((start, stop))
        return read(self, start, stop)

    monkeypatch.setattr(TokenCache, "read", counted)
    return paths, reads


def sections(paths, **train):
    return dict(data=dict(source="cache", paths=paths, weights=(3, 1), block_rows=8,
                          stages=((4, (1, 1)),)),
                train=dict(steps=6, eval_at_end=True, **train),
                checkpoint=dict(enabled=True, every_steps=2, keep=2))


def test_cache_run_logs_data_tokens_and_resumes_exactly(tmp_path, caches):
    paths, reads = caches
    cfg = tiny_config(**sections(paths))
    full_tr = Trainer(cfg, str(tmp_path / "full"), build_model=tiny_decoder.build,
                      devices=devices(8), log=lambda s: None)
    full = full_tr.train()
    assert full["history"][6] < full["history"][1] and "val_loss" in full
    T, B = cfg.train.seq_len, cfg.train.batch_size
    records = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert r["data_tokens/web"] + r["data_tokens/code"] == r["step"] * B * T
    for name, path in zip(("web", "code"), paths):  # against the rows the caches served
        assert train[-1][f"data_tokens/{name}"] == len(reads[path]) * T
    assert train[3]["data_tokens/web"] == 24 * T  # stage 0: 3 of every 4 rows
    assert train[5]["data_tokens/web"] == (24 + 8) * T  # stage (1, 1) from step 4 on

    wd = str(tmp_path / "killed")
    tr = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(8), log=lambda s: None)
    preempt_after(tr, 3)
    assert tr.train()["step"] == 3
    again = Trainer(cfg, wd, build_model=tiny_decoder.build, devices=devices(8),
                    log=lambda s: None).train()
    for k in (4, 5, 6):  # across the stage change at step 4
        assert again["history"][k] == full["history"][k]


def test_cache_of_another_tokenizer_fails_before_compiling(tmp_path, monkeypatch):
    paths = (str(tmp_path / "web"),)
    memory_caches(monkeypatch, TOK, {paths[0]: dict(train=corpus(0, 9), validation=corpus(1, 2))},
                  tokenizer_name="gpt2", fingerprint="0" * 64)
    with pytest.raises(ValueError, match=f"data.paths: {paths[0]} was prepared with tokenizer "
                                         f"'gpt2', but data.tokenizer='byte'"):
        Trainer(tiny_config(data=dict(source="cache", paths=paths)), str(tmp_path / "w"),
                build_model=tiny_decoder.build, devices=devices(1), log=lambda s: None)


def test_objectives_that_pack_documents_read_caches(caches):
    paths, _ = caches
    for objective in ("causal_lm", "prefix_lm", "mlm", "span_corruption"):
        obj = OBJECTIVES.get(objective)
        cfg = tiny_config(data=dict(source="cache", paths=paths), train=dict(objective=objective))
        it = obj.batches(cfg, TOK, obj.source(cfg, "train"), [1, 2], True)
        b = next(it)
        assert all(v.shape[0] == 2 for v in b.values()), objective
        assert sum(it.data_tokens(1).values()) > 0 and it.get_state() == dict(batch=1)
    cfg = tiny_config(data=dict(source="cache", paths=paths),
                      train=dict(objective="classification"))
    with pytest.raises(ValueError, match="data.source: a token cache feeds the objectives that "
                                         "pack documents .* not train.objective='classification'"):
        check_objective(cfg, TOK)
