"""Post-training through the one trainer: preference pairs packed into rows (the packed
forward equals the unpacked one), the tiny DPO preset from a tiny Hugging Face Llama
(rewards move the right way, resume is exact), distillation from a teacher, and bad input
refused in one line before anything compiles."""

from __future__ import annotations

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pairs_data import write_pairs
from tiny_hf import save_tiny_llama
from tiny_setup import preempt_after, tiny_config

from tfjax import config as C
from tfjax.data.pairs import PAIR_KEYS, encode_pairs, pair_batches, pair_row
from tfjax.data.tokenizer import ByteTokenizer
from tfjax.models import build
from tfjax.train import Trainer
from tfjax.train.checkpoint import load_run
from tfjax.train.preference import pair_sums

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

PAIRS = [dict(prompt="copy apple:", chosen=" apple", rejected=" a river, or stone"),
         dict(prompt="Q: 2+2?", chosen=" 4", rejected=" five"),
         dict(prompt="Name a colour:", chosen=" blue, or green", rejected=" cat")]


def _hf_llama(path, vocab_size=272, seed=0):
    save_tiny_llama(path, seed=seed, vocab_size=vocab_size)
    return str(path)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return _hf_llama(tmp_path_factory.mktemp("hf_llama"))


def _rows(enc, groups, T):
    tok = ByteTokenizer()
    rows = [pair_row([enc[i] for i in g], T, tok) for g in groups]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def test_pair_rows_hold_whole_pairs_scored_on_the_responses():
    tok = ByteTokenizer()
    enc = encode_pairs(PAIRS, tok, 80)
    row = pair_row(enc[:2], 80, tok)
    assert set(row) == set(PAIR_KEYS) and row["pairs"] == 2
    seg = row["segment_ids"]
    assert list(np.unique(seg)) == [0, 1, 2, 3, 4]  # chosen 1, rejected 2; next pair 3, 4
    for s in (1, 2, 3, 4):  # positions restart with each sequence
        assert row["positions"][seg == s][0] == 0
    # scored targets: the response tokens and EOS of each sequence, nothing of the prompt
    p, c = tok.encode(PAIRS[0]["prompt"]), tok.encode(PAIRS[0]["chosen"])
    assert row["mask"][seg == 1].sum() == len(c) + 1
    np.testing.assert_array_equal(row["targets"][(seg == 1) & (row["mask"] > 0)],
                                  [*c, tok.eos_id])
    assert row["seq_mask"][seg == 1].sum() == len(p) + len(c) + 1  # ORPO's NLL: all targets
    assert not row["mask"][seg == 0].any() and not row["seq_mask"][seg == 0].any()
    # rows take the next pair while it fits, never half a pair
    with pytest.raises(ValueError, match="do not fit a row"):
        pair_row(enc, 80, tok)
    it = pair_batches(enc, tok, seq_len=80, global_batch=1, shuffle=False, repeat=False)
    got = [b["pairs"][0] for b in it]
    assert sum(got) == 3 and max(got) >= 2


def test_packed_forward_equals_unpacked():
    """Pairs packed two to a row give the sums of each pair in a row of its own (the
    segment ids and positions keep the sequences apart), with a reference too; and
    `loss_chunk` gives the same sums as the whole logits."""
    m = tiny_config().model
    policy = build(m, rngs=nnx.Rngs(0))
    ref = build(m, rngs=nnx.Rngs(1))
    policy.eval(), ref.eval()
    enc = encode_pairs(PAIRS, ByteTokenizer(), 80)
    cfg = C.PreferenceConfig(beta=0.5)
    (gp, sp), (gr, sr) = nnx.split(policy), nnx.split(ref)

    @jax.jit
    def f(sp, sr, b):
        out = {kind: pair_sums(kind, cfg, nnx.merge(gp, sp), b, nnx.merge(gr, sr))
               for kind in ("dpo", "orpo")}
        # train.loss_chunk: the log-probs 16 positions at a time, through the head
        out["chunked"] = pair_sums("orpo", cfg, nnx.merge(gp, sp), b, nnx.merge(gr, sr),
                                   loss_chunk=16)
        return out

    packed = f(sp, sr, _rows(enc, [[0, 1], [2]], 80))
    alone = f(sp, sr, _rows(enc, [[0], [1], [2]], 80))
    for kind in packed:
        assert set(packed[kind]) == set(alone[kind])
        for k in packed[kind]:
            np.testing.assert_allclose(packed[kind][k], alone[kind][k], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{kind} {k}")
        assert float(packed[kind]["tokens"]) == 3
    for k in packed["orpo"]:
        np.testing.assert_allclose(packed["chunked"][k], packed["orpo"][k], rtol=2e-5,
                                   atol=2e-5, err_msg=f"chunked {k}")


def test_bad_pairs_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                   '{"prompt": "a", "rejected": "c"}\n')
    cfg = tiny_config(train=dict(objective="orpo"),
                      data=dict(source="jsonl", paths=(str(bad),), val_paths=(str(bad),)))
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'chosen' must be a non-empty"):
        Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)
    for side in ("chosen", "rejected"):  # an empty response
        empty = tmp_path / f"empty_{side}.jsonl"
        empty.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                         + json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", side: ""})
                         + "\n")
        cfg = tiny_config(train=dict(objective="orpo"),
                          data=dict(source="jsonl", paths=(str(empty),), val_paths=(str(bad),)))
        with pytest.raises(ValueError, match=rf"empty_{side}\.jsonl:2: field '{side}' must be "
                                             rf"a non-empty") as e:
            Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)
        assert "\n" not in str(e.value)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps(dict(prompt="p" * 30, chosen="c", rejected="r")) + "\n")
    cfg = tiny_config(train=dict(objective="simpo", seq_len=32),
                      data=dict(source="jsonl", paths=(str(long),), val_paths=(str(long),)))
    tr = Trainer(cfg, str(tmp_path / "w2"), devices=jax.devices()[:1], log=lambda s: None)
    with pytest.raises(ValueError, match=r"long\.jsonl:1: prompt \+ chosen and prompt \+ "
                                         r"rejected are 66 tokens.*train\.seq_len to 65"):
        tr.train_iterator()
    longer = tmp_path / "longer.jsonl"  # the prompt alone is longer than seq_len
    longer.write_text(json.dumps(dict(prompt="c", chosen="c", rejected="r")) + "\n"
                      + json.dumps(dict(prompt="p" * 40, chosen="c", rejected="r")) + "\n")
    cfg = tiny_config(train=dict(objective="simpo", seq_len=32),
                      data=dict(source="jsonl", paths=(str(longer),), val_paths=(str(long),)))
    tr = Trainer(cfg, str(tmp_path / "w4"), devices=jax.devices()[:1], log=lambda s: None)
    with pytest.raises(ValueError, match=r"longer\.jsonl:2: prompt \+ chosen .* 86 tokens") as e:
        tr.train_iterator()
    assert "\n" not in str(e.value)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    no_rejected = tmp_path / "no_rejected.parquet"  # parquet pairs (tests/data/test_examples.py)
    pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"]}), no_rejected)
    cfg = tiny_config(train=dict(objective="orpo"),
                      data=dict(source="jsonl", paths=(str(no_rejected),), val_paths=(str(bad),)))
    with pytest.raises(ValueError, match=r"no_rejected\.parquet: no column 'rejected'; its "
                                         r"columns: prompt, chosen") as e:
        Trainer(cfg, str(tmp_path / "w5"), devices=jax.devices()[:1], log=lambda s: None)
    assert "\n" not in str(e.value)
    cfg = tiny_config(train=dict(objective="orpo"))  # the stdlib corpus has no pairs
    with pytest.raises(ValueError, match=r"data\.source: train\.objective='orpo' reads"):
        Trainer(cfg, str(tmp_path / "w3"), devices=jax.devices()[:1], log=lambda s: None)


def test_parquet_pairs_train_as_the_jsonl_ones(tmp_path):
    """The trainer's batches of the same pairs as jsonl and as parquet are the same
    (every kind: tests/data/test_examples.py)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    jsonl = write_pairs(tmp_path / "pairs.jsonl", n=16)
    records = [json.loads(line) for line in open(jsonl)]
    pq.write_table(pa.table({k: [r[k] for r in records] for k in records[0]}),
                   tmp_path / "pairs.parquet")

    def first_batch(path, name):
        cfg = tiny_config(train=dict(objective="orpo", batch_size=2, seq_len=128),
                          data=dict(source="jsonl", paths=(path,), val_paths=(jsonl,)))
        tr = Trainer(cfg, str(tmp_path / name), devices=jax.devices()[:1], log=lambda s: None)
        return next(tr.train_iterator())

    got, want = first_batch(str(tmp_path / "pairs.parquet"), "p"), first_batch(jsonl, "j")
    assert set(got) == set(want) and want["pairs"].sum() > 2
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_reference_and_teacher_errors(tmp_path, hf_llama):
    """dpo / ipo without init_from (no reference); a teacher of another vocabulary;
    a teacher with no distill objective: one line each, before anything compiles."""
    for kind in ("dpo", "ipo"):
        with pytest.raises(ValueError, match=rf"train\.objective: '{kind}' compares the policy "
                                             r"with its starting point.*init_from is empty"):
            C.from_dict(C.RunConfig, dict(train=dict(objective=kind))).validate()
    with pytest.raises(ValueError, match=r"train\.teacher: .*needs a teacher"):
        C.from_dict(C.RunConfig, dict(train=dict(objective="distill"))).validate()
    with pytest.raises(ValueError, match=r"train\.teacher: a teacher is read by"):
        C.from_dict(C.RunConfig, dict(train=dict(teacher=hf_llama))).validate()
    cfg = tiny_config(train=dict(objective="distill", teacher=hf_llama))  # vocab 259 vs 272
    with pytest.raises(ValueError, match=r"train\.teacher: .* has vocab_size 272, the student "
                                         r"model\.vocab_size 259.*the student's tokenizer"):
        Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)
    cfg = tiny_config(train=dict(objective="distill", teacher=str(tmp_path)))
    with pytest.raises(ValueError, match=r"train\.teacher: .* is not a checkpoint"):
        Trainer(cfg, str(tmp_path / "w"), devices=jax.devices()[:1], log=lambda s: None)


def _dpo_config(init_from, data, **train):
    preset = importlib.import_module("configs.dpo").get_config("tiny")
    preset.init_from = init_from
    preset.data.paths = (data,)
    preset.data.val_paths = (data,)
    preset.train.update(dict(progress=False, **train))
    preset.mesh.data = 1
    return C.run_config(preset)


def _records(wd):
    return [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]


@pytest.mark.slow
def test_dpo_preset_trains_and_resumes_exactly(tmp_path, hf_llama):
    """configs/dpo.py:tiny from a tiny HF Llama: rewards/accuracies and margins rise over
    the run of 24 steps (logged as TRL logs them, eval too); a run stopped at step 5 and resumed
    gives the same losses bitwise (the reference is restored with the state)."""
    data = write_pairs(tmp_path / "pairs.jsonl", 96)
    cfg = _dpo_config(hf_llama, data, eval_at_end=True)  # 24 steps
    wd = str(tmp_path / "full")
    full = Trainer(cfg, wd, devices=jax.devices()[:1], log=lambda s: None).train()
    rec = [r for r in _records(wd) if "loss" in r]
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins"} <= set(rec[0])
    def mean(key, rs):
        return np.mean([r[key] for r in rs])

    assert mean("rewards/margins", rec[-6:]) > 0.1 > mean("rewards/margins", rec[:6])
    assert mean("rewards/accuracies", rec[-6:]) > 0.75 > 0.5 > mean("rewards/accuracies", rec[:6])
    assert full["val_rewards/accuracies"] > 0.75 and full["val_rewards/margins"] > 0.1
    assert abs(rec[0]["loss"] - np.log(2)) < 0.05  # step 1: the policy is the reference

    wd2 = str(tmp_path / "killed")
    tr = Trainer(cfg, wd2, devices=jax.devices()[:1], log=lambda s: None)
    preempt_after(tr, 5)
    assert tr.train()["step"] == 5
    tr2 = Trainer(cfg, wd2, devices=jax.devices()[:1], log=lambda s: None)
    s2 = tr2.train()
    assert sorted(s2["history"]) == list(range(6, 25))
    for k in range(6, 25):
        assert s2["history"][k] == full["history"][k]
    # the reference stayed the starting policy: a copy, never updated
    ref = jax.tree.leaves(tr2.state["reference"]["params"])
    start = jax.tree.leaves(Trainer(cfg, str(tmp_path / "fresh"), devices=jax.devices()[:1],
                                    log=lambda s: None).init_state()["params"])
    assert all(np.array_equal(a, b) for a, b in zip(ref, start))


@pytest.mark.slow
def test_distill_preset_from_a_teacher(tmp_path):
    """configs/distill.py:tiny from an HF Llama teacher of the byte vocabulary: the
    divergence falls, and the teacher in the state is the checkpoint's."""
    teacher = _hf_llama(tmp_path / "teacher", vocab_size=259, seed=3)
    preset = importlib.import_module("configs.distill").get_config("tiny")
    preset.train.update(dict(teacher=teacher, steps=12, progress=False, log_every=1,
                             eval_at_end=False))
    preset.mesh.data = 1
    tr = Trainer(C.run_config(preset), str(tmp_path / "w"), devices=jax.devices()[:1],
                 log=lambda s: None)
    s = tr.train()
    h = s["history"]
    assert np.mean([h[k] for k in (10, 11, 12)]) < 0.8 * np.mean([h[k] for k in (1, 2, 3)])
    w = transformers.LlamaForCausalLM.from_pretrained(teacher).lm_head.weight.detach().numpy()
    head = tr.state["reference"]["params"]["embed"]["head"]["kernel"].get_value()
    np.testing.assert_allclose(np.asarray(head), w.T, rtol=1e-6)


@pytest.mark.slow
def test_lora_reference_is_the_frozen_base_and_a_dpo_workdir_starts_another(tmp_path, hf_llama):
    """With LoRA the reference is the frozen base (no copy in the state; step 1's loss is
    log 2, the policy being the base); a DPO workdir is an init_from like any other, its
    trained policy the new run's reference, and `load_run` (export, evaluation) reads it."""
    import dataclasses

    data = write_pairs(tmp_path / "pairs.jsonl", 32)
    cfg = dataclasses.replace(_dpo_config(hf_llama, data, steps=3),
                              lora=C.LoraConfig(rank=4, alpha=8.0, targets="all"))
    tr = Trainer(cfg, str(tmp_path / "lora"), devices=jax.devices()[:1], log=lambda s: None)
    tr.train()
    assert "reference" not in tr.state and "frozen" in tr.state
    assert abs(_records(str(tmp_path / "lora"))[0]["loss"] - np.log(2)) < 1e-6

    first = Trainer(_dpo_config(hf_llama, data, steps=2), str(tmp_path / "dpo"),
                    devices=jax.devices()[:1], log=lambda s: None)
    first.train()
    second = Trainer(_dpo_config(str(tmp_path / "dpo"), data, steps=1), str(tmp_path / "again"),
                     devices=jax.devices()[:1], log=lambda s: None)
    state = second.init_state()
    for a, b in zip(jax.tree.leaves(state["reference"]["params"]),
                    jax.tree.leaves(first.state["params"])):
        np.testing.assert_array_equal(a, b)
    # export / evaluation read the policy of a run whose state also holds the reference
    model, _, _, step = load_run(str(tmp_path / "dpo"))
    assert step == 2
    np.testing.assert_array_equal(model.embed.tokens.embedding.get_value(),
                                  first.state["params"]["embed"]["tokens"]["embedding"].get_value())


@pytest.mark.slow
def test_orpo_microbatches_and_local_gradients_equal_one_batch(tmp_path):
    """Each loss term over its global count: 2 microbatches, and 2 devices summing
    local gradients, give the losses of one batch on one device."""
    data = write_pairs(tmp_path / "pairs.jsonl", 48)
    out = {}
    for name, mesh, micro, n in (("one", 1, 1, 1), ("micro", 1, 2, 1), ("mesh", 2, 2, 2)):
        cfg = tiny_config(train=dict(objective="orpo", steps=3, batch_size=4, seq_len=64,
                                     microbatches=micro),
                          data=dict(source="jsonl", paths=(data,), val_paths=(data,)),
                          mesh=dict(data=mesh))
        tr = Trainer(cfg, str(tmp_path / name), devices=jax.devices()[:n], log=lambda s: None)
        out[name] = tr.train()["history"]
    for name in ("micro", "mesh"):
        np.testing.assert_allclose([out[name][k] for k in (1, 2, 3)],
                                   [out["one"][k] for k in (1, 2, 3)], rtol=1e-5)
