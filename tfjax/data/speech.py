"""Speech-to-text examples (`train.objective="speech_to_text"`): WAV files decoded with
the stdlib `wave` module (16-bit PCM; stereo averaged), examples from jsonl / json /
parquet whose audio column is a WAV path (relative to its file) or the WAV bytes, the
shipped spoken digits (`data.source="synthetic"`), and rows of Whisper's log-mel
features `[n_mels, audio.max_frames]` beside decoder rows [start] text [EOS]. Audio at
another sample rate or longer than the model's window is one line naming the file and
row. `python -m tfjax.data.speech DIR` writes the spoken digits as files. See
docs/multimodal.md ("Training a speech model").
"""

from __future__ import annotations

import argparse
import io
import json
import wave
from collections.abc import Sequence

import numpy as np
from etils import epath

from tfjax.config import AudioConfig, DataConfig
from tfjax.data.audio import HOP, SAMPLE_RATE, log_mel
from tfjax.data.objectives import ExampleBatches, read_examples, token_bytes_of
from tfjax.data.synthetic_media import digit_text, spoken_digit

__all__ = ["SPEECH_KEYS", "SYNTHETIC_UTTERANCES", "audio_features", "read_wav", "speech_batches",
           "speech_examples", "speech_row", "write_spoken_digits", "write_wav"]

SPEECH_KEYS = ("input_features", "decoder_inputs", "decoder_segment_ids", "decoder_positions",
               "targets", "mask", "target_bytes")
# data.source="synthetic": utterances 0 .. train - 1 of the stream data seed (the run's
# `seed`) train, the next `validation` are held out.
SYNTHETIC_UTTERANCES = dict(train=2048, validation=256)


def _open(source):
    return io.BytesIO(source) if isinstance(source, bytes) else epath.Path(source).open("rb")


def _header(source, where: str) -> tuple[int, int, int]:
    """(frames, sample rate, channels) of a 16-bit PCM WAV, or a one-line ValueError."""
    try:
        with _open(source) as f, wave.open(f, "rb") as w:
            width, rate = w.getsampwidth(), w.getframerate()
            frames, channels = w.getnframes(), w.getnchannels()
    except (wave.Error, EOFError) as e:
        raise ValueError(f"{where}: not a readable WAV file ({e}); write 16-bit PCM WAV "
                         f"(e.g. soundfile.write(path, x, 16000, subtype='PCM_16'))") from None
    if width != 2:
        raise ValueError(f"{where}: {8 * width}-bit samples; expected 16-bit PCM WAV (convert "
                         f"it, e.g. sox in.wav -b 16 out.wav)")
    return frames, rate, channels


def read_wav(source: str | bytes, where: str = "") -> tuple[np.ndarray, int]:
    """(waveform float32 `[samples]` = int16 / 32768, sample rate) of a 16-bit PCM WAV
    file (a path, local or on a bucket) or its bytes; the channels of a stereo (or
    more) file are averaged. Anything else: one line naming `where` (default: the path)."""
    where = where or (source if isinstance(source, str) else "WAV bytes")
    _header(source, where)
    with _open(source) as f, wave.open(f, "rb") as w:
        channels, rate = w.getnchannels(), w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    x = pcm.reshape(-1, channels).astype(np.float32) / 32768
    return (x[:, 0] if channels == 1 else x.mean(1)), rate


def write_wav(path, waveform, sample_rate: int = SAMPLE_RATE) -> None:
    """A mono 16-bit PCM WAV of `waveform` (floats in [-1, 1], rounded to k / 32768)."""
    pcm = np.clip(np.rint(np.asarray(waveform, np.float64) * 32768), -32768, 32767)
    with epath.Path(path).open("wb") as f, wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.astype("<i2").tobytes())


def check_audio(samples: int, rate: int, where: str, audio: AudioConfig) -> None:
    """One line naming `where` unless the audio is at 16 kHz and fits the model's
    window of `audio.max_frames` frames (10 ms each)."""
    if rate != SAMPLE_RATE:
        raise ValueError(f"{where}: audio at {rate} Hz; expected {SAMPLE_RATE} Hz (Whisper's "
                         f"features): resample it first (e.g. librosa.resample)")
    most = audio.max_frames * HOP
    if samples > most:
        raise ValueError(f"{where}: audio of {samples / rate:.2f} s ({samples} samples); "
                         f"expected at most {most / rate:.2f} s, the model's window of "
                         f"{audio.max_frames} frames (model.audio.max_source_positions="
                         f"{audio.max_source_positions}): cut the audio or raise "
                         f"max_source_positions")


def audio_features(waveform: np.ndarray, audio: AudioConfig) -> np.ndarray:
    """`[audio.n_mels, audio.max_frames]` log-mel features of a 16 kHz waveform,
    zero-padded to the window as Whisper pads to 30 s."""
    return log_mel(waveform, sampling_rate=SAMPLE_RATE, n_mels=audio.n_mels,
                   seconds=audio.max_frames * HOP / SAMPLE_RATE)


def speech_examples(cfg: DataConfig, split: str, audio: AudioConfig, seed: int = 0) -> list[dict]:
    """The examples of `split`: dicts of `audio` (a WAV path or bytes; with
    data.source="synthetic" the utterance's index in the stream `seed`), `text` and
    `where`. Every file's header is checked here, before anything compiles
    (`check_audio`; a path that does not exist, a WAV that is not 16-bit PCM)."""
    if cfg.source == "synthetic":
        n = SYNTHETIC_UTTERANCES
        first = 0 if split == "train" else n["train"]
        return [dict(audio=i, seed=seed, where=f"spoken digits utterance {i}")
                for i in range(first, first + n[split])]
    out = []
    for ex in read_examples(cfg, split, {"audio": "file", "text": "text"}, where=True):
        if isinstance(ex["audio"], str) and not epath.Path(ex["audio"]).exists():
            raise ValueError(f"{ex['where']}: field 'audio': no WAV file {ex['audio']} (a path "
                             f"relative to the examples' file, or the WAV bytes)")
        frames, rate, _ = _header(ex["audio"], ex["where"])
        check_audio(frames, rate, ex["where"], audio)
        out.append(ex)
    return out


def _waveform(ex: dict) -> tuple[np.ndarray, str]:
    if isinstance(ex["audio"], (int, np.integer)):  # a synthetic utterance
        wave_, digits = spoken_digit(ex["seed"], ex["audio"])
        return wave_, digit_text(digits)
    return read_wav(ex["audio"], ex["where"])[0], ex["text"]


def speech_row(examples: list[dict], target_len: int, tokenizer, n_mels: int,
               frames: int, start: Sequence[int]) -> dict:
    """One example per row (none: an empty row, mask 0): `input_features` `[n_mels,
    frames]`; the decoder row [start ...] text [EOS] (text cut to fit `target_len`
    + 1 tokens), its inputs all but the last token, targets all but the first, the
    loss (mask) on the text and EOS, segment 1 and positions from 0 where real."""
    z = np.zeros(target_len, np.int32)
    if not examples:
        return dict(input_features=np.zeros((n_mels, frames), np.float32),
                    decoder_inputs=np.full(target_len, tokenizer.pad_id, np.int32),
                    decoder_segment_ids=z, decoder_positions=z, targets=z.copy(), mask=z.copy(),
                    target_bytes=z.copy())
    (ex,) = examples
    ids = np.asarray(ex["ids"], np.int32)[: target_len + 1 - len(start) - 1]
    row = np.concatenate([np.asarray(start, np.int32), ids, [tokenizer.eos_id]]).astype(np.int32)
    n = len(row) - 1
    inputs = np.full(target_len, tokenizer.pad_id, np.int32)
    inputs[:n] = row[:-1]
    targets = z.copy()
    targets[:n] = row[1:]
    seg = z.copy()
    seg[:n] = 1
    mask = z.copy()
    mask[len(start) - 1:n] = 1
    return dict(input_features=ex["features"], decoder_inputs=inputs, decoder_segment_ids=seg,
                decoder_positions=np.arange(target_len, dtype=np.int32) * seg, targets=targets,
                mask=mask, target_bytes=token_bytes_of(tokenizer, targets) * mask)


def speech_batches(examples: Sequence[dict], tokenizer, audio: AudioConfig, *, target_len: int,
                   global_batch: int, local_rows=None, seed: int = 0, shuffle: bool = True,
                   repeat: bool = True, start: Sequence[int] | None = None,
                   cache_bytes: int = 256 << 20) -> ExampleBatches:
    """Checkpointable batches of `SPEECH_KEYS` (`speech_row`): features computed on the
    host as each row is read, the first `cache_bytes` of them kept for the next epochs
    (a pure function of the example: resume is unchanged); `start`: the decoder's start
    tokens (default the tokenizer's BOS)."""
    start = (tokenizer.bos_id,) if start is None else tuple(start)
    kept: dict[str, dict] = {}
    room = [cache_bytes]

    def encode(ex):
        if ex["where"] in kept:
            return kept[ex["where"]]
        waveform, text = _waveform(ex)
        check_audio(waveform.size, SAMPLE_RATE, ex["where"], audio)
        out = dict(features=audio_features(waveform, audio), ids=tokenizer.encode(text))
        if out["features"].nbytes <= room[0]:
            kept[ex["where"]] = out
            room[0] -= out["features"].nbytes
        return out

    return ExampleBatches(
        examples, encode,
        lambda exs: speech_row(exs, target_len, tokenizer, audio.n_mels, audio.max_frames, start),
        global_batch=global_batch, local_rows=local_rows, seed=seed, shuffle=shuffle,
        repeat=repeat)


def write_spoken_digits(directory, *, seed: int = 0, count: int, start: int = 0,
                        name: str = "train") -> dict[str, str]:
    """Utterances `start` .. `start + count - 1` of the stream `seed` as files in
    `directory`: `audio/<index>.wav`, `<name>.jsonl` (`{"audio": "audio/<index>.wav",
    "text": ...}` a line) and `<name>.parquet` (columns `audio`: the WAV bytes, `text`).
    Returns {"jsonl": path, "parquet": path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = epath.Path(directory)
    (d / "audio").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(start, start + count):
        waveform, digits = spoken_digit(seed, i)
        rel = f"audio/{i:06d}.wav"
        write_wav(d / rel, waveform)
        rows.append(dict(audio=rel, text=digit_text(digits)))
    jsonl, parquet = d / f"{name}.jsonl", d / f"{name}.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({"audio": [(d / r["audio"]).read_bytes() for r in rows],
                      "text": [r["text"] for r in rows]})
    with parquet.open("wb") as f:
        pq.write_table(table, f)
    return dict(jsonl=str(jsonl), parquet=str(parquet))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write the shipped spoken digits as WAV files "
                                "with train / validation jsonl and parquet (WAV bytes).")
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=256, help="train utterances")
    p.add_argument("--val_count", type=int, default=32)
    a = p.parse_args(argv)
    for name, count, first in (("train", a.count, 0),
                               ("validation", a.val_count, SYNTHETIC_UTTERANCES["train"])):
        out = write_spoken_digits(a.directory, seed=a.seed, count=count, start=first, name=name)
        print(f"{name}: {count} utterances: {out['jsonl']}, {out['parquet']}")


if __name__ == "__main__":
    main()
