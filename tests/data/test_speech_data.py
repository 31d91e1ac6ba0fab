"""tfjax.data.speech: WAV files round-trip and decode as the stdlib writes them, examples
read from jsonl (paths relative to the file), json and parquet (WAV bytes) give the
same waveforms, a speech row is the hand-made one, and bad audio is one line naming
the file, the row and what was expected."""

import io
import json
import re
import wave

import numpy as np
import pytest

from tfjax.config import AudioConfig, DataConfig
from tfjax.data.speech import (SPEECH_KEYS, audio_features, read_wav, speech_batches,
                               speech_examples, speech_row, write_spoken_digits, write_wav)
from tfjax.data.synthetic_media import digit_text, spoken_digit
from tfjax.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
AUDIO = AudioConfig(n_mels=16, max_source_positions=100)  # 200 frames: 2 s windows


def raw_wav(path, pcm, rate=16000, channels=1, width=2):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def test_wav_round_trip_and_stereo_is_averaged(tmp_path):
    x = np.array([0, 1, -1, 32767, -32768, 1000], "<i2")
    raw_wav(tmp_path / "m.wav", x)
    got, rate = read_wav(str(tmp_path / "m.wav"))
    assert rate == 16000 and got.dtype == np.float32
    np.testing.assert_array_equal(got, x / 32768)
    write_wav(tmp_path / "w.wav", got, 8000)  # ours back: the same samples
    again, rate = read_wav((tmp_path / "w.wav").read_bytes())
    assert rate == 8000
    np.testing.assert_array_equal(again, got)
    stereo = np.array([[100, 300], [-50, 50], [7, 8]], "<i2")
    raw_wav(tmp_path / "s.wav", stereo.reshape(-1), channels=2)
    got, _ = read_wav(str(tmp_path / "s.wav"))
    np.testing.assert_allclose(got, stereo.mean(1) / 32768, rtol=1e-6)


def examples_from(path, split="train", **kw):
    cfg = DataConfig(source="jsonl", paths=(str(path),), val_paths=(str(path),))
    return speech_examples(cfg, split, AUDIO, **kw)


def test_jsonl_json_and_parquet_give_the_same_audio(tmp_path):
    files = write_spoken_digits(tmp_path / "d", seed=3, count=5, start=7)
    lines = [json.loads(line) for line in open(files["jsonl"])]
    assert [r["audio"] for r in lines] == [f"audio/{i:06d}.wav" for i in range(7, 12)]
    (tmp_path / "d" / "list.json").write_text(json.dumps(lines))
    got = {name: examples_from(path) for name, path in
           (("jsonl", files["jsonl"]), ("json", tmp_path / "d" / "list.json"),
            ("parquet", files["parquet"]))}
    assert isinstance(got["parquet"][0]["audio"], bytes)
    assert got["jsonl"][0]["audio"] == str(tmp_path / "d" / "audio" / "000007.wav")
    for k, i in enumerate(range(7, 12)):
        waveform, digits = spoken_digit(3, i)
        for name, exs in got.items():
            assert exs[k]["text"] == digit_text(digits), name
            np.testing.assert_array_equal(read_wav(exs[k]["audio"])[0], waveform, err_msg=name)


def test_a_speech_row_is_the_hand_made_one():
    feats = np.arange(16 * 200, dtype=np.float32).reshape(16, 200)
    ids = TOK.encode("one two")  # 7 bytes
    row = speech_row([dict(features=feats, ids=ids)], 12, TOK, 16, 200, start=(TOK.bos_id,))
    bos, eos, pad = TOK.bos_id, TOK.eos_id, TOK.pad_id
    text = list(b"one two")
    np.testing.assert_array_equal(row["decoder_inputs"], [bos] + text + [pad] * 4)
    np.testing.assert_array_equal(row["targets"], text + [eos] + [0] * 4)
    np.testing.assert_array_equal(row["mask"], [1] * 8 + [0] * 4)
    np.testing.assert_array_equal(row["decoder_segment_ids"], [1] * 8 + [0] * 4)
    np.testing.assert_array_equal(row["decoder_positions"], list(range(8)) + [0] * 4)
    np.testing.assert_array_equal(row["target_bytes"], [1] * 7 + [0] * 5)  # EOS: no bytes
    assert row["input_features"] is feats
    # two start tokens (Whisper's forced prefix): the loss starts after the last
    row = speech_row([dict(features=feats, ids=ids)], 12, TOK, 16, 200, start=(bos, 7))
    np.testing.assert_array_equal(row["decoder_inputs"], [bos, 7] + text + [pad] * 3)
    np.testing.assert_array_equal(row["targets"], [7] + text + [eos] + [0] * 3)
    np.testing.assert_array_equal(row["mask"], [0] + [1] * 8 + [0] * 3)
    # a text longer than the row is cut, the EOS kept; an empty row scores nothing
    row = speech_row([dict(features=feats, ids=ids)], 5, TOK, 16, 200, start=(bos,))
    np.testing.assert_array_equal(row["targets"], text[:4] + [eos])
    empty = speech_row([], 5, TOK, 16, 200, start=(bos,))
    assert empty["input_features"].shape == (16, 200) and not empty["mask"].any()


def test_batches_hold_the_utterances_features(tmp_path):
    files = write_spoken_digits(tmp_path, seed=0, count=3)
    exs = examples_from(files["parquet"])
    b = next(speech_batches(exs, TOK, AUDIO, target_len=24, global_batch=3, shuffle=False))
    assert sorted(b) == sorted(SPEECH_KEYS)
    assert b["input_features"].shape == (3, 16, 200) and b["input_features"].dtype == np.float32
    for r in range(3):
        waveform, digits = spoken_digit(0, r)
        np.testing.assert_array_equal(b["input_features"][r], audio_features(waveform, AUDIO))
        n = int(b["mask"][r].sum())
        assert TOK.decode(b["targets"][r][:n - 1]) == digit_text(digits)


def test_synthetic_examples_hold_out_validation():
    cfg = DataConfig(source="synthetic")
    train, val = speech_examples(cfg, "train", AUDIO), speech_examples(cfg, "validation", AUDIO)
    assert {e["audio"] for e in train}.isdisjoint(e["audio"] for e in val)
    assert len(val) >= 64


def bad_file(tmp_path, name, rate=16000, seconds=0.5, width=2, fmt="jsonl"):
    pcm = np.zeros(int(rate * seconds) * width // 2, "<i2")
    raw_wav(tmp_path / name, pcm, rate=rate, width=width)
    rows = [dict(audio="ok.wav", text="one"), dict(audio=name, text="two")]
    raw_wav(tmp_path / "ok.wav", np.zeros(800, "<i2"))
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.table({"audio": [(tmp_path / r["audio"]).read_bytes() for r in rows],
                          "text": [r["text"] for r in rows]})
        pq.write_table(table, tmp_path / "ex.parquet")
        return tmp_path / "ex.parquet"
    (tmp_path / "ex.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "ex.jsonl"


BAD = [
    (dict(rate=8000), "ex.jsonl:2: audio at 8000 Hz; expected 16000 Hz (Whisper's features): "
                      "resample it first"),
    (dict(seconds=2.5), "ex.jsonl:2: audio of 2.50 s (40000 samples); expected at most 2.00 s, "
                        "the model's window of 200 frames (model.audio.max_source_positions=100)"
                        ": cut the audio or raise max_source_positions"),
    (dict(rate=44100, fmt="parquet"), "ex.parquet: row 1 (0-based): audio at 44100 Hz; "
                                      "expected 16000 Hz"),
    (dict(width=1), "ex.jsonl:2: 8-bit samples; expected 16-bit PCM WAV"),
]


@pytest.mark.parametrize("kw,message", BAD)
def test_bad_audio_names_the_file_and_row(tmp_path, kw, message):
    path = bad_file(tmp_path, "bad.wav", **kw)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        examples_from(path)
    assert "\n" not in str(e.value)


def test_missing_or_garbled_audio_names_the_row(tmp_path):
    (tmp_path / "ex.jsonl").write_text(json.dumps(dict(audio="nope.wav", text="one")) + "\n")
    with pytest.raises(ValueError, match=r"ex.jsonl:1: field 'audio': no WAV file .*nope.wav"):
        examples_from(tmp_path / "ex.jsonl")
    (tmp_path / "x.wav").write_bytes(b"RIFF not really")
    (tmp_path / "ex.jsonl").write_text(json.dumps(dict(audio="x.wav", text="one")) + "\n")
    with pytest.raises(ValueError, match=r"ex.jsonl:1: not a readable WAV file"):
        examples_from(tmp_path / "ex.jsonl")
    (tmp_path / "ex.jsonl").write_text(json.dumps(dict(audio=3, text="one")) + "\n")
    with pytest.raises(ValueError, match=r"ex.jsonl:1: field 'audio' must be a path \(relative "
                                         r"to this file\) or the file's bytes"):
        examples_from(tmp_path / "ex.jsonl")


def test_bytes_in_memory_are_read_like_a_file(tmp_path):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.array([5, -5], "<i2").tobytes())
    got, rate = read_wav(buf.getvalue())
    np.testing.assert_array_equal(got, np.array([5, -5]) / 32768)
