"""Greedy answers of a trained image_lm run on the held-out shape scenes.

    python experiments/vlm_answers.py --workdir /tmp/paligemma

Loads the run's newest checkpoint (`tfjax.train.checkpoint.load_run`), decodes every
validation example of `data.source="synthetic"` greedily (KV-cached, the image and the
prompt as the prefix, up to EOS) and prints a table of exact-match accuracy per task
(captions; questions about shape, colour, place) and a few captions beside the truth.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from tfjax.data.image_text import image_text_examples
from tfjax.data.images import load_image, pixel_values
from tfjax.inference import generate
from tfjax.train.checkpoint import load_run


def task_of(prompt: str) -> str:
    if prompt.startswith("caption"):
        return "caption"
    return "VQA " + ("shape" if "what shape" in prompt else
                     "colour" if "what colour" in prompt else "place")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--show", type=int, default=6, help="captions to print")
    args = p.parse_args(argv)
    model, cfg, tok, step = load_run(args.workdir)
    v = cfg.model.vision
    examples = image_text_examples(cfg.data, "validation", v)
    hits, counts, shown = collections.Counter(), collections.Counter(), []
    for ex in examples:
        prompt = [v.image_token_id] * v.num_patches + [tok.bos_id] + list(
            tok.encode(ex["prompt"] + "\n"))
        pixels = pixel_values(load_image(ex["image"], ex["where"], v))[None]
        out = np.asarray(generate(model, np.asarray([prompt], np.int32), max_new_tokens=48,
                                  eos_id=tok.eos_id, pixel_values=pixels))[0].tolist()
        answer = tok.decode(out[:out.index(tok.eos_id)] if tok.eos_id in out else out)
        task = task_of(ex["prompt"])
        counts[task] += 1
        hits[task] += answer == ex["target"]
        if task == "caption" and len(shown) < args.show:
            shown.append((ex["target"], answer))
    print(f"step {step}, {len(examples)} held-out examples (data.source={cfg.data.source!r})\n")
    print("| task | examples | greedy answer = target |\n|---|---|---|")
    for task in sorted(counts):
        print(f"| {task} | {counts[task]} | {hits[task] / counts[task]:.2f} |")
    total = sum(hits.values()) / sum(counts.values())
    print(f"| all | {sum(counts.values())} | {total:.2f} |\n")
    print("| caption (truth) | greedy caption |\n|---|---|")
    for want, got in shown:
        print(f"| {want} | {got} |")


if __name__ == "__main__":
    main()
