"""A tiny synthetic preference set for the post-training tests: the prompt names a word,
the chosen response copies it, the rejected one says another word."""

import json
import random

WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel", "lemon",
         "comet", "amber", "delta")


def pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w, other = rng.sample(WORDS, 2)
        out.append(dict(prompt=f"copy {w}:", chosen=f" {w}", rejected=f" {other}"))
    return out


def write_pairs(path, n: int = 64, seed: int = 0) -> str:
    with open(path, "w") as f:
        for p in pairs(n, seed):
            f.write(json.dumps(p) + "\n")
    return str(path)
