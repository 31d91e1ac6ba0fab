"""Speech to text on the shipped spoken digits: `configs/whisper.py:tiny` through the one
trainer (`train.objective="speech_to_text"`, `data.source="synthetic"`), then greedy
transcriptions of held-out utterances (the validation stream, never trained on) and
their digit accuracy (digits right at their position / digits spoken) and exact match.

    python experiments/speech_digits.py            # the preset's 400 steps, minutes on 2 cores
    python experiments/speech_digits.py --quick    # 6 steps, proves it runs

Results: experiments/results/speech_digits.md; quoted in
experiments/results/multimodal_training.md ("Audio").
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
from common import Experiment, preset_config


def transcribe(trainer, state, count: int) -> list[tuple[str, str]]:
    """(reference, greedy transcription) of the first `count` held-out utterances."""
    from tfjax.data.speech import SYNTHETIC_UTTERANCES, audio_features
    from tfjax.data.synthetic_media import digit_text, spoken_digit
    from tfjax.models.speech import generate

    cfg, tok = trainer.cfg, trainer.tokenizer
    first = SYNTHETIC_UTTERANCES["train"]
    refs, feats = [], []
    for i in range(first, first + count):
        waveform, digits = spoken_digit(cfg.seed, i)
        refs.append(digit_text(digits))
        feats.append(audio_features(waveform, cfg.model.audio))
    prompt = np.full((count, 1), tok.bos_id, np.int32)
    out = np.asarray(generate(trainer.model(state), np.stack(feats), prompt,
                              max_new_tokens=cfg.train.seq_len - 1, eos_id=tok.eos_id))
    hyps = []
    for row in out:
        ids = list(row)
        ids = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids
        hyps.append(tok.decode([t for t in ids if t < 256]))
    return list(zip(refs, hyps))


def digit_scores(pairs) -> tuple[float, float]:
    """(digits right at their position / digits spoken, exact-match rate)."""
    right = sum(sum(a == b for a, b in zip(r.split(), h.split())) for r, h in pairs)
    return right / sum(len(r.split()) for r, _ in pairs), float(np.mean([r == h for r, h in pairs]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="0: the preset's")
    p.add_argument("--held_out", type=int, default=64)
    exp = Experiment("speech_digits", __doc__, parser=p, argv=argv)
    a = exp.args
    import jax

    from tfjax.config import run_config
    from tfjax.train import Trainer

    preset = preset_config("whisper", "tiny")
    preset.checkpoint.enabled = False
    preset.train.progress = False
    if exp.quick:
        preset.train.update(dict(steps=6, eval_every=0, eval_batches=1, log_every=2))
        a.held_out = 4
    elif a.steps:
        preset.train.steps = a.steps
    cfg = run_config(preset)
    found = {}

    def hook(trainer, state):  # after every evaluation: greedy digits of held-out audio
        pairs = transcribe(trainer, state, a.held_out)
        acc, exact = digit_scores(pairs)
        found[int(state["step"])] = (acc, exact, pairs)
        return {"digit_accuracy": acc, "exact_match": exact}

    lines, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(cfg, workdir, eval_hooks=[hook],
                          log=lambda s: (print(s, flush=True), lines.append(s)))
        summary = trainer.train()
    load.append(os.getloadavg()[0])
    h = summary["history"]
    steps = sorted(h)
    exp.text(f"`configs/whisper.py:tiny`, {cfg.train.steps} steps of {cfg.train.batch_size} "
             f"utterances, {len(jax.devices())} CPU device(s); the machine was shared with "
             f"other jobs (1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at "
             f"the end, on {os.cpu_count()} cores), so times are loose.")
    shown = sorted(set(steps[:: max(1, len(steps) // 10)]) | {steps[-1]})
    exp.table(["step", "train loss"], [[s, float(h[s])] for s in shown],
              title="Training loss (nats per token)")
    exp.table(["step", "digit accuracy", "exact match"],
              [[s, v[0], v[1]] for s, v in sorted(found.items())],
              title=f"Greedy transcription of {a.held_out} held-out utterances")
    last = found[max(found)][2]
    exp.table(["spoken", "transcribed"], [[r, h or "(empty)"] for r, h in last[:8]],
              title="Examples (last evaluation)")
    exp.text("Log:\n\n```text\n" + "\n".join(line for line in lines
                                            if "loss" in line or "wall" in line) + "\n```")
    exp.finish()


if __name__ == "__main__":
    main()
