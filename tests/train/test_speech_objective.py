"""train.objective="speech_to_text" through the one trainer: the shipped spoken digits
train (the loss falls, eval reports val_loss and val_accuracy), files written from
them (jsonl + WAV, parquet of WAV bytes) give the built-in source's batches, resume
is exact, a data x fsdp mesh matches one device, and config errors name the field."""

import json
import re

import jax
import numpy as np
import pytest
from tiny_setup import devices, preempt_after, run, tiny_config

from tfjax.data.speech import SYNTHETIC_UTTERANCES, write_spoken_digits
from tfjax.data.tokenizer import ByteTokenizer
from tfjax.train import Trainer
from tfjax.train.objectives import OBJECTIVES

TOK = ByteTokenizer()
MODEL = dict(arch="encoder_decoder", vocab_size=259, d_model=32, num_heads=4, num_kv_heads=0,
             d_ff=64, num_layers=1, max_len=32, position="learned", norm="layernorm",
             activation="gelu", audio=dict(n_mels=16, max_source_positions=100))


def config(train=None, data=None, model=None, **sections):
    return tiny_config(model={**MODEL, **(model or {})},
                       train={**dict(objective="speech_to_text", batch_size=4, seq_len=32,
                                     steps=6, lr=3e-3), **(train or {})},
                       data={**dict(source="synthetic"), **(data or {})}, **sections)


def batches(cfg, split="train", n=2):
    obj = OBJECTIVES.get("speech_to_text")
    it = obj.batches(cfg, TOK, obj.source(cfg, split), range(cfg.train.batch_size),
                     split == "train")
    return it, [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """6 steps of 4 spoken-digit utterances on one device, evaluated at the end."""
    return run(tmp_path_factory.mktemp("speech"), config(train=dict(eval_at_end=True),
                                                         mesh=dict(data=1)))


def test_speech_to_text_trains_and_evaluates(reference):
    _, s = reference
    h = [s["history"][k] for k in sorted(s["history"])]
    assert len(h) == 6 and np.isfinite(h).all() and h[-1] < h[0] - 0.3, h
    assert np.isfinite(s["val_loss"]) and 0.0 <= s["val_accuracy"] <= 1.0
    assert "val_bpb" not in s


def test_files_give_the_built_in_sources_batches(tmp_path):
    """The same utterances written as jsonl + WAV and as parquet (WAV bytes) read back
    into the batches the built-in source makes, train and validation."""
    train = write_spoken_digits(tmp_path, seed=0, count=8, name="train")
    val = write_spoken_digits(tmp_path, seed=0, count=4, start=SYNTHETIC_UTTERANCES["train"],
                              name="validation")
    plain = dict(shuffle=False)
    _, want = batches(config(data=plain))
    _, want_val = batches(config(data=plain), "validation", 1)
    for kind in ("jsonl", "parquet"):
        cfg = config(data=dict(plain, source="jsonl", paths=(train[kind],),
                               val_paths=(val[kind],)))
        _, got = batches(cfg)
        _, got_val = batches(cfg, "validation", 1)
        for w, g in zip(want + want_val, got + got_val):
            assert sorted(w) == sorted(g)
            for key in w:
                np.testing.assert_array_equal(g[key], w[key], err_msg=f"{kind} {key}")


def test_batches_resume_exactly():
    cfg = config()
    it, _ = batches(cfg, n=2)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(2)]
    resumed, _ = batches(cfg, n=0)
    resumed.set_state(state)
    for w in want:
        g = next(resumed)
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_speech_resume_is_exact(tmp_path, reference):
    ref_tr, ref = reference
    cfg = config(mesh=dict(data=1), checkpoint=dict(enabled=True, every_steps=2, keep=2))
    wd = str(tmp_path / "killed")
    tr = Trainer(cfg, wd, devices=devices(1), log=lambda s: None)
    preempt_after(tr, 3)
    assert tr.train()["step"] == 3
    s2 = Trainer(cfg, wd, devices=devices(1), log=lambda s: None)
    got = s2.train()
    assert sorted(got["history"]) == [4, 5, 6]
    for k in (4, 5, 6):
        assert got["history"][k] == ref["history"][k]
    for a, b in zip(jax.tree.leaves(s2.state["params"]), jax.tree.leaves(ref_tr.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_speech_on_a_data_fsdp_mesh_matches_one_device(tmp_path, reference):
    _, ref = reference
    _, s = run(tmp_path, config(mesh=dict(data=2, fsdp=2)), n_devices=4)
    for k in sorted(ref["history"]):
        np.testing.assert_allclose(s["history"][k], ref["history"][k], rtol=2e-4)


BAD = [
    (dict(model=dict(audio=dict(n_mels=0))), "train.objective: 'speech_to_text' needs the audio "
     "front end: set --config.model.audio.n_mels"),
    (dict(train=dict(target_len=40)), "train.target_len: the decoder length 40 > "
     "model.max_len=32"),
    (dict(train=dict(objective="causal_lm"), model=dict(arch="decoder", audio=dict(n_mels=0),
                                                        position="rope")),
     "data.source: 'synthetic' (shipped examples) feeds 'image_lm', 'speech_to_text', not "
     "train.objective='causal_lm'"),
]


@pytest.mark.parametrize("kw,message", BAD)
def test_speech_config_errors_name_the_field(tmp_path, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(config(**kw), str(tmp_path), devices=devices(1), log=lambda s: None)


def test_synthetic_source_takes_no_paths():
    with pytest.raises(ValueError, match=re.escape("data.paths: data.source='synthetic' (the "
                                                   "objective's shipped examples) takes no paths")):
        config(data=dict(paths=("x.jsonl",))).validate()


def test_too_long_audio_stops_the_run_before_compiling(tmp_path):
    """Item 7 through the trainer: a clip longer than the model's window."""
    files = write_spoken_digits(tmp_path, seed=0, count=3)
    cfg = config(data=dict(source="jsonl", paths=(files["jsonl"],), val_paths=(files["jsonl"],)),
                 model=dict(audio=dict(n_mels=16, max_source_positions=25)))
    with pytest.raises(ValueError, match=r"train.jsonl:\d: audio of [\d.]+ s \(\d+ samples\); "
                                         r"expected at most 0.50 s"):
        Trainer(cfg, str(tmp_path / "w"), devices=devices(1), log=lambda s: None)
