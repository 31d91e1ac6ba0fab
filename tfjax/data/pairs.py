"""Preference pairs as packed rows: each `{"prompt", "chosen", "rejected"}` example becomes
two sequences, `[bos] + prompt + chosen + [eos]` and `[bos] + prompt + rejected + [eos]`,
laid side by side in one row (segments 2k + 1 and 2k + 2 for the row's k-th pair,
positions from 0 each), as many whole pairs per row as fit. `mask` scores the response
tokens and their EOS only, `seq_mask` every target inside a sequence (ORPO's NLL
reads the whole chosen sequence, as TRL's does), `pairs` counts a row's pairs. See
docs/training.md ("Post-training").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tfjax.data.objectives import ExampleBatches, read_examples
from tfjax.data.pipeline import BATCH_KEYS, row_batch

__all__ = ["PAIR_KEYS", "encode_pairs", "pair_batches", "pair_examples", "pair_row"]

PAIR_KEYS = (*BATCH_KEYS, "seq_mask", "pairs")


def pair_examples(cfg, split: str) -> list[dict]:
    """The pairs of `split` from `data.paths` / `data.val_paths` (jsonl lines, parquet or
    `datasets` columns: `read_examples`); a record without a non-empty prompt, chosen or
    rejected string is a ValueError naming its line or row."""
    return read_examples(cfg.data, split, {"prompt": "text", "chosen": "text",
                                           "rejected": "text"}, where=True)


def encode_pairs(examples: Sequence[dict], tokenizer, seq_len: int) -> list[dict]:
    """Each pair's two sequences as ids and scored flags; a pair whose two sequences do
    not fit one row of `seq_len` targets is a ValueError naming its line."""
    bos, eos = [tokenizer.bos_id], [tokenizer.eos_id]
    out = []
    for ex in examples:
        prompt = list(tokenizer.encode(ex["prompt"]))
        seqs = []
        for side in ("chosen", "rejected"):
            response = list(tokenizer.encode(ex[side]))
            ids = np.asarray(bos + prompt + response + eos, np.int32)
            scored = np.concatenate([np.zeros(1 + len(prompt)), np.ones(len(response) + 1)])
            seqs.append((ids, scored.astype(np.int32)))
        n = len(seqs[0][0]) + len(seqs[1][0])
        if n > seq_len + 1:
            raise ValueError(f"{ex.get('where', 'a pair')}: prompt + chosen and prompt + "
                             f"rejected are {n} tokens together, more than a row holds "
                             f"(train.seq_len + 1 = {seq_len + 1}); raise --config.train."
                             f"seq_len to {n - 1} or more, or shorten the pair")
        out.append(dict(seqs=seqs, length=n))
    return out


def pair_row(pairs: list[dict], seq_len: int, tokenizer) -> dict:
    """Whole pairs laid end to end in one row -> `PAIR_KEYS` arrays (`pairs` a scalar)."""
    need = seq_len + 1
    if sum(p["length"] for p in pairs) > need:
        raise ValueError(f"pair_row: {len(pairs)} pairs of {sum(p['length'] for p in pairs)} "
                         f"tokens do not fit a row of {need}")
    toks = np.full(need, tokenizer.pad_id, np.int32)
    seg, pos, score = (np.zeros(need, np.int32) for _ in range(3))
    at, piece = 0, 0
    for pair in pairs:
        for ids, scored in pair["seqs"]:
            piece += 1
            n = len(ids)
            toks[at:at + n], score[at:at + n], seg[at:at + n] = ids, scored, piece
            pos[at:at + n] = np.arange(n)
            at += n
    row = row_batch(tokenizer, toks, seg, pos, score)
    row["seq_mask"] = ((seg[:-1] == seg[1:]) & (seg[:-1] > 0)).astype(np.int32)
    row["pairs"] = np.int32(len(pairs))
    return row


def pair_batches(pairs: list[dict], tokenizer, *, seq_len: int, global_batch: int,
                 local_rows=None, seed: int = 0, shuffle: bool = True,
                 repeat: bool = True) -> ExampleBatches:
    """Checkpointable batches of packed pairs (`ExampleBatches`: row r reads its own
    stream of the shuffled pairs, taking the next while it fits)."""
    def fits(taken, ex):
        return sum(p["length"] for p in taken) + ex["length"] <= seq_len + 1

    return ExampleBatches(pairs, lambda ex: ex, lambda exs: pair_row(exs, seq_len, tokenizer),
                          global_batch=global_batch, local_rows=local_rows, seed=seed,
                          shuffle=shuffle, repeat=repeat, fits=fits)
