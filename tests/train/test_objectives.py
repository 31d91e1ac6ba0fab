"""Training objectives (`tfjax.train.objectives`, `tfjax.data.objectives`): the host-side
transforms on small numpy inputs (MLM's proportions and whole words, span corruption
round-trips, prefix-LM and seq2seq masks, packing that is exact), each objective's
loss through the one trainer, exact resume and a data x fsdp mesh for MLM, and the
config errors."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_setup import devices, losses, preempt_after, run, tiny_config

from tfjax.data import objectives as D
from tfjax.data.tokenizer import ByteTokenizer
from tfjax.models import build
from tfjax.train import Trainer
from tfjax.train.objectives import OBJECTIVES

TOK = ByteTokenizer()
MODEL = {  # tiny_setup's 2-layer d=32 model, per architecture
    "causal_lm": {},
    "prefix_lm": dict(prefix_lm=True),
    "mlm": dict(arch="encoder", vocab_size=260),
    "classification": dict(arch="encoder", num_classes=2),
    "span_corruption": dict(arch="encoder_decoder", vocab_size=264),
    "seq2seq": dict(arch="encoder_decoder"),
}


def config(objective, model=None, train=None, **sections):
    return tiny_config(model={**MODEL[objective], **(model or {})},
                       train={**dict(objective=objective, batch_size=4, steps=6), **(train or {})},
                       **sections)


def text_rows(n, T, seed=0):
    """Rows of English-ish bytes (words and spaces), all real, one segment."""
    rng = np.random.default_rng(seed)
    words = [w.encode() for w in "the quick brown fox jumps over a lazy dog again".split()]
    rows = []
    for _ in range(n):
        b = b" ".join(words[i] for i in rng.integers(0, len(words), T))[:T]
        rows.append(np.frombuffer(b, np.uint8).astype(np.int32))
    return np.stack(rows)


# --------------------------------------------------------------- host side
def test_mlm_selects_15_percent_80_10_10():
    tokens = text_rows(400, 64)
    tokens[:, :2] = [TOK.bos_id, TOK.pad_id]  # specials are never selected
    seg = np.ones_like(tokens)
    packed = dict(inputs=tokens, segment_ids=seg, positions=np.zeros_like(tokens))
    out = D.mlm_batch(packed, 0, range(400), tokenizer=TOK, seed=0, rate=0.15, whole_word=False)
    sel = out["mask"].astype(bool)
    assert not sel[:, :2].any()
    np.testing.assert_array_equal(sel.sum(1), round(0.15 * 62))  # BERT: round(rate * n) per row
    np.testing.assert_array_equal(out["targets"], tokens)
    masked = out["inputs"] == 259
    assert not (masked & ~sel).any() and (out["inputs"][~sel] == tokens[~sel]).all()
    n = sel.sum()
    kept = (out["inputs"] == tokens) & sel
    swapped = sel & ~masked & ~kept
    assert abs(masked.sum() / n - 0.8) < 0.02
    assert abs(kept.sum() / n - 0.1) < 0.02  # includes the 1-in-256 random draws of itself
    assert abs(swapped.sum() / n - 0.1) < 0.02
    assert (out["inputs"][swapped] < 256).all()  # random *real* tokens
    np.testing.assert_array_equal(out["target_bytes"], sel)  # one byte per selected target
    again = D.mlm_batch(packed, 0, range(400), tokenizer=TOK, seed=0, rate=0.15, whole_word=False)
    other = D.mlm_batch(packed, 1, range(400), tokenizer=TOK, seed=0, rate=0.15, whole_word=False)
    np.testing.assert_array_equal(again["inputs"], out["inputs"])  # (seed, batch, row) decides
    assert (other["mask"] != out["mask"]).any()


def test_whole_word_masking_selects_whole_words():
    tokens = text_rows(200, 64, seed=1)
    seg = np.ones_like(tokens)
    packed = dict(inputs=tokens, segment_ids=seg, positions=np.zeros_like(tokens))
    out = D.mlm_batch(packed, 0, range(200), tokenizer=TOK, seed=0, rate=0.15, whole_word=True)
    sel = out["mask"].astype(bool)
    for r in range(200):
        units = D.word_units(tokens[r], np.ones(64, bool), seg[r])
        for u in np.unique(units):
            s = sel[r][units == u]
            assert s.all() or not s.any()  # a word is selected whole or not at all
        assert 0 < sel[r].sum() <= round(0.15 * 64)
    assert abs(sel.mean() - 0.15) < 0.03
    # words: maximal runs of non-whitespace bytes, each space its own unit
    u = D.word_units(np.frombuffer(b"ab cd  e", np.uint8).astype(np.int32), np.ones(8, bool),
                     np.ones(8, np.int32))
    assert u.tolist() == [0, 0, 1, 2, 2, 3, 4, 5]


def test_span_corruption_round_trips():
    sentinels = D.special_ids(TOK, 40)
    for seed in range(50):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 300))
        tokens = rng.integers(0, 256, n).astype(np.int32)
        noise = D.span_noise_mask(n, rng, 0.15, 3.0)
        num_noise, spans = D.span_counts(n, 0.15, 3.0)
        assert noise.sum() == num_noise and not noise[0]  # a non-noise span first
        assert (np.diff(noise.astype(int)) == 1).sum() == spans
        enc, tgt = D.span_corrupt(tokens, noise, sentinels, TOK.eos_id)
        assert enc[-1] == tgt[-1] == TOK.eos_id and tgt[0] == sentinels[0]
        # re-insert each sentinel's span into the encoder input: the original row
        pieces = np.split(tgt[:-1], np.flatnonzero(tgt[:-1] >= 259)[1:])
        spans_of = {int(p[0]): p[1:] for p in pieces}
        rebuilt = np.concatenate([spans_of[int(t)] if t >= 259 else [t] for t in enc[:-1]])
        np.testing.assert_array_equal(rebuilt, tokens)
    raw, Td, spans = D.span_lengths(512, 0.15, 3.0)
    assert (raw, Td, spans) == (568, 114, 28)  # T5's 512 -> 568 raw tokens, 114 targets


def test_span_corruption_batch_fits_and_pads():
    raw, Td, spans = D.span_lengths(32, 0.15, 3.0)
    tokens = np.full((3, raw), TOK.pad_id, np.int32)
    seg = np.zeros((3, raw), np.int32)
    tokens[0], seg[0] = np.arange(raw) % 200, 1
    tokens[1, :10], seg[1, :10] = np.arange(10), 1  # a short last row
    out = D.span_corruption_batch(dict(inputs=tokens, segment_ids=seg), 0, [0, 1, 2],
                                  tokenizer=TOK, seed=0, density=0.15, mean_span=3.0,
                                  seq_len=32, target_len=8, num_sentinels=spans)
    assert out["encoder_inputs"].shape == (3, 32) and out["targets"].shape == (3, 8)
    assert out["encoder_segment_ids"][0].all()  # the full row fills the encoder exactly
    assert out["mask"][2].sum() == 0 and out["encoder_segment_ids"][2].sum() == 0  # empty
    for r in (0, 1):
        m = out["mask"][r].astype(bool)
        np.testing.assert_array_equal(out["decoder_inputs"][r][1:m.sum()],
                                      out["targets"][r][:m.sum() - 1])  # shifted right
        assert out["decoder_inputs"][r][0] == TOK.pad_id  # T5's decoder start
        np.testing.assert_array_equal(out["target_bytes"][r], m & (out["targets"][r] < 256))


def test_prefix_lm_scores_only_the_continuation():
    T = 16
    seg = np.ones((64, T), np.int32)
    seg[0, 10:] = 0  # a row with 10 real inputs
    packed = dict(inputs=np.zeros((64, T), np.int32), targets=np.zeros((64, T), np.int32),
                  positions=np.zeros((64, T), np.int32), segment_ids=seg,
                  mask=np.ones((64, T), np.int32), target_bytes=np.ones((64, T), np.int32))
    out = D.prefix_lm_batch(packed, 3, range(64), seed=0)
    P = out["prefix_lengths"]
    assert P.min() >= 1 and P.max() <= T - 1 and P[0] <= 9 and len(set(P)) > 5
    for r in range(64):  # target t (of token t+1) is scored iff token t+1 is after the prefix
        np.testing.assert_array_equal(out["mask"][r], np.arange(T) >= P[r] - 1)
    np.testing.assert_array_equal(out["target_bytes"], out["mask"])


def test_seq2seq_rows_pack_examples_apart():
    exs = [dict(enc=np.array([1, 2, 3, TOK.eos_id]), tgt=np.array([7, 8, TOK.eos_id])),
           dict(enc=np.array([4, 5, TOK.eos_id]), tgt=np.array([9, TOK.eos_id]))]
    row = D.seq2seq_row(exs, 8, 6, TOK)
    assert row["encoder_segment_ids"].tolist() == [1, 1, 1, 1, 2, 2, 2, 0]
    assert row["encoder_positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert row["decoder_segment_ids"].tolist() == [1, 1, 1, 2, 2, 0]
    assert row["decoder_positions"].tolist() == [0, 1, 2, 0, 1, 0]
    p = TOK.pad_id
    assert row["decoder_inputs"].tolist() == [p, 7, 8, p, 9, p]  # each example starts anew
    assert row["targets"].tolist()[:5] == [7, 8, TOK.eos_id, 9, TOK.eos_id]
    assert row["mask"].tolist() == [1, 1, 1, 1, 1, 0]
    assert row["target_bytes"].tolist() == [1, 1, 0, 1, 0, 0]
    fits = D.fits_both(8, 6)
    assert fits(exs[:1], exs[1]) and not fits(exs, exs[1])


def test_packed_seq2seq_is_exact():
    """The packed row's logits are those of each example run alone."""
    cfg = config("seq2seq").model
    model = build(cfg, rngs=nnx.Rngs(0))
    exs = [dict(enc=np.array([11, 12, 13, 14, TOK.eos_id]), tgt=np.array([21, 22, TOK.eos_id])),
           dict(enc=np.array([31, 32, TOK.eos_id]), tgt=np.array([41, 42, 43, TOK.eos_id]))]

    def logits(row):
        b = {k: jnp.asarray(v)[None] for k, v in row.items()}
        return np.asarray(model(b["encoder_inputs"], b["decoder_inputs"], b["encoder_segment_ids"],
                                b["decoder_segment_ids"], b["encoder_positions"],
                                b["decoder_positions"]))[0]

    packed = logits(D.seq2seq_row(exs, 12, 8, TOK))
    first, second = logits(D.seq2seq_row(exs[:1], 12, 8, TOK)), logits(D.seq2seq_row(exs[1:], 12, 8, TOK))
    np.testing.assert_allclose(packed[:3], first[:3], atol=1e-5)
    np.testing.assert_allclose(packed[3:7], second[:4], atol=1e-5)


def test_mlm_loss_counts_only_the_selected_tokens():
    cfg = config("mlm").model
    model = build(cfg, rngs=nnx.Rngs(0))
    tokens = text_rows(2, 16)
    packed = dict(inputs=tokens, segment_ids=np.ones_like(tokens),
                  positions=np.broadcast_to(np.arange(16), tokens.shape).astype(np.int32))
    b = D.mlm_batch(packed, 0, [0, 1], tokenizer=TOK, seed=0, rate=0.15, whole_word=False)
    sums = OBJECTIVES.get("mlm").forward(model, {k: jnp.asarray(v) for k, v in b.items()})
    logits = np.asarray(model(jnp.asarray(b["inputs"]), segment_ids=jnp.asarray(b["segment_ids"]),
                              positions=jnp.asarray(b["positions"])), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    sel = b["mask"].astype(bool)
    nll = -np.take_along_axis(logp, tokens[..., None], -1)[..., 0][sel].sum()
    assert float(sums["tokens"]) == sel.sum() == 2 * round(0.15 * 16)
    np.testing.assert_allclose(float(sums["nll"]), nll, rtol=1e-4)
    hits = (logits.argmax(-1) == tokens)[sel].sum()
    assert float(sums["correct"]) == hits


# ------------------------------------------------------------ jsonl files
@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """seq2seq pairs (target = the input reversed) and classification texts (label:
    whether the text starts with "yes")."""
    d = tmp_path_factory.mktemp("jsonl")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta eps zeta eta theta".split()

    def write(name, n, make):
        with open(d / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps(make()) + "\n")
        return str(d / name)

    def pair():
        s = " ".join(rng.choice(words, int(rng.integers(1, 3))))
        return dict(input=s, target=s[::-1])

    def labelled():
        y = int(rng.integers(0, 2))
        return dict(text=("yes " if y else "no ") + " ".join(rng.choice(words, 3)), label=y)

    return dict(seq2seq=(write("s2s.jsonl", 64, pair), write("s2s_val.jsonl", 8, pair)),
                classification=(write("cls.jsonl", 64, labelled),
                                write("cls_val.jsonl", 8, labelled)))


def jsonl_data(jsonl, objective):
    train, val = jsonl[objective]
    return dict(source="jsonl", paths=(train,), val_paths=(val,))


def test_examples_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 2}\n')
    cfg = config("classification", data=dict(source="jsonl", paths=(str(bad),),
                                             val_paths=(str(bad),)))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'label' must be an integer class "
                                         r"in \[0, 2\) \(model.num_classes=2\), got 2"):
        Trainer(cfg, str(tmp_path / "w"), devices=devices(1), log=lambda s: None)


# ------------------------------------------------------- through the trainer
@pytest.fixture(scope="module")
def mlm_reference(tmp_path_factory):
    """6 MLM steps of batch 8 on one device, evaluated at the end."""
    cfg = config("mlm", train=dict(batch_size=8, eval_at_end=True), mesh=dict(data=1))
    return run(tmp_path_factory.mktemp("mlm"), cfg)


def test_mlm_trains_and_reports_accuracy(mlm_reference):
    tr, s = mlm_reference
    got = losses(s)
    assert len(got) == 6 and np.isfinite(got).all() and got[-1] < got[0], got
    assert "val_bpb" not in s and 0.0 <= s["val_accuracy"] <= 1.0 and np.isfinite(s["val_loss"])
    records = [json.loads(line) for line in open(os.path.join(tr.workdir, "metrics.jsonl"))]
    assert "accuracy" in records[0] and "bpb" not in records[0]


@pytest.mark.slow
def test_mlm_resume_is_exact(tmp_path, mlm_reference):
    ref_tr, ref = mlm_reference
    cfg = config("mlm", train=dict(batch_size=8), mesh=dict(data=1),
                 checkpoint=dict(enabled=True, every_steps=2, keep=2))
    wd = str(tmp_path / "killed")
    tr = Trainer(cfg, wd, devices=devices(1), log=lambda s: None)
    preempt_after(tr, 3)
    assert tr.train()["step"] == 3
    tr2 = Trainer(cfg, wd, devices=devices(1), log=lambda s: None)
    s2 = tr2.train()
    assert sorted(s2["history"]) == [4, 5, 6]
    for k in (4, 5, 6):
        assert s2["history"][k] == ref["history"][k]  # bitwise: same program, same masks
    for a, b in zip(jax.tree.leaves(tr2.state["params"]), jax.tree.leaves(ref_tr.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_mlm_on_a_data_fsdp_mesh_matches_one_device(tmp_path, mlm_reference):
    _, ref = mlm_reference
    tr, s = run(tmp_path, config("mlm", train=dict(batch_size=8), mesh=dict(data=2, fsdp=4)),
                n_devices=8)
    emb = tr.state["params"]["embed"]["tokens"]["embedding"].get_value()
    assert "fsdp" in str(emb.sharding.spec)  # parameters really are sharded
    np.testing.assert_allclose(losses(s), losses(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["span_corruption", "prefix_lm", "seq2seq",
                                       "classification"])
def test_objective_trains(tmp_path, jsonl, objective):
    data = jsonl_data(jsonl, objective) if objective in jsonl else {}
    cfg = config(objective, train=dict(eval_at_end=objective == "classification",
                                       sample_tokens=3 if objective == "prefix_lm" else 0),
                 mesh=dict(data=1), data=data)
    _, s = run(tmp_path, cfg)
    assert ("sample" in s) == (objective == "prefix_lm")  # the prompt is the prefix
    got = losses(s)
    assert len(got) == 6 and np.isfinite(got).all(), got
    if objective == "classification":  # 4 examples a step: too noisy for a trend in 6 steps
        assert 0.0 <= s["val_accuracy"] <= 1.0 and "val_bpb" not in s
    else:
        assert got[-1] < got[0], got


def test_presets_train_out_of_the_box(tmp_path):
    """bert.py:tiny and t5.py:tiny pass every check (the mask token and sentinels fit
    their vocabulary) and build their programs; their training runs are above."""
    from test_presets_train import preset

    from tfjax import config as C
    for name, objective in (("bert", "mlm"), ("t5", "span_corruption")):
        cd = preset(name)
        assert cd.train.objective == objective
        cd.mesh.data = 1
        tr = Trainer(C.run_config(cd), str(tmp_path / name), devices=devices(1),
                     log=lambda s: None)
        assert tr.objective is OBJECTIVES.get(objective)


BAD = [
    (dict(objective="mlm"), {},
     "train.objective: 'mlm' trains arch='encoder' models, but model.arch='decoder'; objectives "
     "for 'decoder': 'causal_lm', 'distill', 'dpo', 'grpo', 'image_lm', 'ipo', 'orpo', 'prefix_lm', "
     "'simpo'"),
    (dict(objective="causal_lm"), dict(arch="encoder"),
     "objectives for 'encoder': 'classification', 'mlm'"),
    (dict(objective="mlm"), dict(arch="encoder", vocab_size=259),
     "model.vocab_size: 259 has no room for the mask token of train.objective='mlm' (1 id(s) "
     "from 259, above the tokenizer's vocabulary); set --config.model.vocab_size=260 or more"),
    (dict(objective="span_corruption"), dict(arch="encoder_decoder", vocab_size=260),
     "set --config.model.vocab_size=261 or more"),
    (dict(objective="prefix_lm"), {}, "set --config.model.prefix_lm=True"),
    (dict(objective="causal_lm"), dict(prefix_lm=True), "--config.train.objective=prefix_lm"),
    (dict(objective="classification"), dict(arch="encoder"), "set --config.model.num_classes"),
    (dict(objective="span_corruption", target_len=6), dict(arch="encoder_decoder", vocab_size=264),
     "train.target_len: 6 cannot hold span corruption's targets of train.seq_len=32 (8 tokens)"),
    (dict(objective="mlmm"), {}, "unknown train.objective='mlmm'; allowed: causal_lm, "
     "classification, distill, dpo, grpo, image_lm, ipo, mlm, orpo, prefix_lm, seq2seq, simpo, "
     "span_corruption, speech_to_text"),
]


@pytest.mark.parametrize("train,model,message", BAD)
def test_objective_errors_name_the_field(tmp_path, train, model, message):
    cfg = tiny_config(model=model, train=train)
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(cfg, str(tmp_path), devices=devices(1), log=lambda s: None)


@pytest.mark.parametrize("objective", sorted(MODEL))
def test_every_objectives_batches_resume_exactly(jsonl, objective):
    """What a checkpoint holds of the data (the iterator's JSON state) continues every
    objective's batches exactly: the masking, corruption and prefix draws included."""
    cfg = config(objective, data=jsonl_data(jsonl, objective) if objective in jsonl else {})
    obj = OBJECTIVES.get(objective)
    source = obj.source(cfg, "train")
    rows = range(cfg.train.batch_size)
    it = obj.batches(cfg, TOK, source, rows, True)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    resumed = obj.batches(cfg, TOK, source, rows, True)
    resumed.set_state(state)
    for w, g in zip(want, (next(resumed) for _ in range(3))):
        assert sorted(w) == sorted(g)
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["span_corruption", "seq2seq", "classification"])
def test_objective_on_a_data_fsdp_mesh_matches_one_device(tmp_path, jsonl, objective):
    """The encoder-decoder and classification batches shard like the decoder's: 3 steps
    on data=2 x fsdp=4 equal one device's."""
    data = jsonl_data(jsonl, objective) if objective in jsonl else {}

    def three_steps(mesh, n, name):
        cfg = config(objective, train=dict(batch_size=8, steps=3), mesh=mesh, data=data)
        return run(tmp_path, cfg, n_devices=n, name=name)

    _, one = three_steps(dict(data=1), 1, "one")
    tr, s = three_steps(dict(data=2, fsdp=4), 8, "mesh")
    emb = tr.state["params"]["embed"]["tokens"]["embedding"].get_value()
    assert "fsdp" in str(emb.sharding.spec)
    np.testing.assert_allclose(losses(s), losses(one), rtol=2e-5, atol=2e-5)
