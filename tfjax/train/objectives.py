"""Training objectives: one record (`Objective`) per `train.objective`, registered once in
`OBJECTIVES` (causal_lm, prefix_lm, mlm, classification, span_corruption, seq2seq,
speech_to_text, the preference objectives, distill, grpo) and read by the trainer (the data source, the batches and their shapes, the checks, what
evaluation reports) and by the step (how to call the model, the loss sums).
`check_objective` checks the objective against the model, the tokenizer and the sequence
shards; `eval_metrics` turns evaluation sums into val_loss, val_bpb, val_accuracy.
Adding an objective is one registration here (and its host-side transform in
`tfjax.data.objectives`). See docs/training.md ("Objectives: every architecture through
the one trainer").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from tfjax.config import RunConfig, TrainConfig
from tfjax.data import objectives as D
from tfjax.data.mixture import MixtureBatches, open_caches
from tfjax.data.pipeline import BATCH_KEYS, PackedBatches
from tfjax.data.pairs import PAIR_KEYS, encode_pairs, pair_batches, pair_examples
from tfjax.data.sources import documents
from tfjax.data.speech import SPEECH_KEYS, speech_batches, speech_examples
from tfjax.models.mtp import mtp_predictions
from tfjax.registry import Registry
from tfjax.train.distill import distill_sums
from tfjax.train.losses import LN2, chunked_cross_entropy_sums, cross_entropy_sums
from tfjax.train.preference import pair_sums

__all__ = ["OBJECTIVES", "Objective", "bound_objective", "check_objective", "encdec_lengths", "eval_line",
           "eval_metrics"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the trainer and the step need to know of one objective.

    arch: the `model.arch` it trains. source(cfg, split): the documents or examples.
    batches(cfg, tokenizer, source, local_rows, train): a checkpointable iterator of
    numpy batches (`get_state` / `set_state`). shapes(cfg): each batch key's global
    shape. forward(model, batch, loss_chunk=0): the loss sums (nll, z, tokens, bytes,
    and `extra`); `loss_chunk` (`train.loss_chunk`) is read by the decoder objectives,
    whose next-token loss then goes through the model's `features` and `head`
    (`chunked_cross_entropy_sums`); the others materialise their logits.
    specials(cfg): ids it needs above the tokenizer's vocabulary, and what they are.
    check(cfg, tokenizer, n_seq): its own config checks (n_seq: sequence shards).
    """

    arch: str
    source: Callable
    batches: Callable
    shapes: Callable
    forward: Callable
    specials: Callable[[RunConfig], tuple[int, str]] = lambda cfg: (0, "")
    check: Callable = lambda cfg, tokenizer, n_seq: None
    extra: tuple[str, ...] = ()  # sums beyond nll, z, tokens, bytes (e.g. "correct")
    bits_per_byte: bool = False  # val_bpb is reported
    compression: bool = False  # ... beside gzip / xz on the same bytes
    samples: bool = False  # a greedy sample at the end (decoder LMs)
    zigzag: bool = False  # batches may be put in zig-zag order (`model.attention.zigzag="data"`)
    # A loss of several terms, each summed and divided by its own count: ((sum, count),
    # ...), with `counts(batch)` -> {count: global value} for the step (None: nll / tokens)
    terms: tuple[tuple[str, str], ...] | None = None
    counts: Callable | None = None
    # report(sums) -> the metrics logged beside the loss (train; "val_" + name in eval)
    report: Callable[[dict], dict] | None = None
    # bind(train config) -> forward, for an objective whose forward reads its config
    bind: Callable | None = None
    synthetic: bool = False  # reads its shipped examples with data.source="synthetic"


OBJECTIVES: Registry[Objective] = Registry("objective")


def _documents(cfg, split):
    """The documents of `split`, or with data.source="cache" its token caches."""
    if cfg.data.source == "cache":
        return open_caches(cfg.data, split)
    return documents(cfg.data, split)


def _packed(cfg, tokenizer, source, local_rows, train, seq_len=None):
    t, d = cfg.train, cfg.data
    if d.source == "cache":  # `source`: the caches (`_documents`)
        return MixtureBatches(source, tokenizer, seq_len=seq_len or t.seq_len,
                              global_batch=t.batch_size, local_rows=local_rows,
                              weights=d.weights, stages=d.stages, block_rows=d.block_rows,
                              seed=cfg.seed, shuffle=d.shuffle, repeat=train)
    if train:
        return PackedBatches(source, tokenizer, seq_len=seq_len or t.seq_len,
                             global_batch=t.batch_size, local_rows=local_rows, seed=cfg.seed,
                             shuffle=cfg.data.shuffle, repeat=True)
    return PackedBatches(source, tokenizer, seq_len=seq_len or t.seq_len,
                         global_batch=t.batch_size, local_rows=local_rows, shuffle=False,
                         repeat=False)


def _lm_shapes(cfg, extra=()):
    t = cfg.train
    return {**{k: (t.batch_size, t.seq_len) for k in BATCH_KEYS},
            **{k: (t.batch_size,) for k in extra}}


def _correct(logits, targets, mask):
    hit = jnp.argmax(logits, -1) == targets
    return (hit * mask.astype(jnp.float32)).sum()


def _head_sums(model, features, targets, mask, target_bytes, loss_chunk):
    """The head's cross-entropy sums over `features` `[B,T,D]`; with `loss_chunk` (and
    T > loss_chunk) a chunk of positions at a time."""
    if loss_chunk and targets.shape[1] > loss_chunk:
        return chunked_cross_entropy_sums(model.head, features, targets, mask, target_bytes,
                                          chunk=loss_chunk)
    return cross_entropy_sums(model.head(features), targets, mask, target_bytes)


def _next_token_sums(model, b, loss_chunk, **kwargs):
    """A decoder's next-token loss sums; with `loss_chunk` (and T > loss_chunk) from
    `model.features` and `model.head` (`model(...) == model.head(model.features(...))`)
    a chunk of positions at a time. A model with multi-token prediction modules
    (`model.mtp_depth`, `tfjax.models.mtp`) adds `mtp`: model.mtp_loss_weight / D x
    the sum over depths of their nll sums (added to the loss beside the main nll,
    normalised by the same token count)."""
    args = dict(positions=b["positions"], segment_ids=b["segment_ids"], **kwargs)
    chunked = loss_chunk and b["targets"].shape[1] > loss_chunk
    if getattr(model, "mtp", None) is None and not chunked:
        return cross_entropy_sums(model(b["inputs"], **args), b["targets"], b["mask"],
                                  b["target_bytes"])
    hidden = model.hidden(b["inputs"], **args)
    sums = _head_sums(model, model.head_input(hidden), b["targets"], b["mask"],
                      b["target_bytes"], loss_chunk)
    if getattr(model, "mtp", None) is not None:
        depths = mtp_predictions(model, hidden, b)
        nll = sum(_head_sums(model, d["features"], d["targets"], d["mask"], d["target_bytes"],
                             loss_chunk)["nll"] for d in depths)
        sums["mtp"] = model.config.mtp_loss_weight / len(depths) * nll
    return sums


# ---------------------------------------------------------------- causal_lm
def _causal_lm_forward(model, b, loss_chunk=0):
    return _next_token_sums(model, b, loss_chunk)


def _causal_lm_check(cfg, tokenizer, n_seq):
    if cfg.model.prefix_lm:
        raise ValueError("train.objective: 'causal_lm' trains a causal decoder, but "
                         "model.prefix_lm=True; set --config.train.objective=prefix_lm")


OBJECTIVES.register("causal_lm", Objective(
    arch="decoder", source=_documents, batches=_packed, shapes=_lm_shapes,
    forward=_causal_lm_forward, check=_causal_lm_check, bits_per_byte=True, compression=True,
    samples=True, zigzag=True))


# ---------------------------------------------------------------- prefix_lm
def _prefix_lm_batches(cfg, tokenizer, source, local_rows, train):
    return D.MappedBatches(_packed(cfg, tokenizer, source, local_rows, train),
                           lambda b, i, rows: D.prefix_lm_batch(b, i, rows, seed=cfg.seed))


def _prefix_lm_forward(model, b, loss_chunk=0):
    return _next_token_sums(model, b, loss_chunk, prefix_lengths=b["prefix_lengths"])


def _prefix_lm_check(cfg, tokenizer, n_seq):
    if not cfg.model.prefix_lm:
        raise ValueError("train.objective: 'prefix_lm' needs the decoder's bidirectional "
                         "prefix: set --config.model.prefix_lm=True")


OBJECTIVES.register("prefix_lm", Objective(
    arch="decoder", source=_documents, batches=_prefix_lm_batches,
    shapes=lambda cfg: _lm_shapes(cfg, ("prefix_lengths",)), forward=_prefix_lm_forward,
    check=_prefix_lm_check, bits_per_byte=True, samples=True))


# ---------------------------------------------------------------------- mlm
def _mlm_batches(cfg, tokenizer, source, local_rows, train):
    t = cfg.train
    return D.MappedBatches(
        _packed(cfg, tokenizer, source, local_rows, train),
        lambda b, i, rows: D.mlm_batch(b, i, rows, tokenizer=tokenizer, seed=cfg.seed,
                                       rate=t.mlm_rate, whole_word=t.whole_word_mask))


def _mlm_forward(model, b, loss_chunk=0):
    logits = model(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"])
    sums = cross_entropy_sums(logits, b["targets"], b["mask"], b["target_bytes"])
    sums["correct"] = _correct(logits, b["targets"], b["mask"])
    return sums


def _mlm_check(cfg, tokenizer, n_seq):
    if cfg.train.whole_word_mask and tokenizer.__class__.__name__ != "ByteTokenizer":
        raise ValueError(f"train.whole_word_mask: words are defined for data.tokenizer='byte' "
                         f"(a maximal run of non-whitespace bytes), not {cfg.data.tokenizer!r}")


OBJECTIVES.register("mlm", Objective(
    arch="encoder", source=_documents, batches=_mlm_batches, shapes=_lm_shapes,
    forward=_mlm_forward, specials=lambda cfg: (1, "the mask token"), check=_mlm_check,
    extra=("correct",)))


# ----------------------------------------------------------- classification
def _classification_source(cfg, split):
    return D.read_examples(cfg.data, split, {cfg.data.jsonl_field: "text", "label": "label"},
                           num_classes=cfg.model.num_classes)


def _classification_batches(cfg, tokenizer, source, local_rows, train):
    t, field = cfg.train, cfg.data.jsonl_field
    return D.ExampleBatches(
        source, lambda ex: dict(ids=tokenizer.encode(ex[field]), label=ex["label"]),
        lambda exs: D.classification_row(exs, t.seq_len, tokenizer), global_batch=t.batch_size,
        local_rows=local_rows, seed=cfg.seed, shuffle=train and cfg.data.shuffle, repeat=train)


def _classification_forward(model, b, loss_chunk=0):
    logits = model.classify(b["inputs"], segment_ids=b["segment_ids"], positions=b["positions"])
    sums = cross_entropy_sums(logits[:, None], b["labels"][:, None], b["mask"][:, None])
    sums["correct"] = _correct(logits, b["labels"], b["mask"])
    return sums


def _classification_check(cfg, tokenizer, n_seq):
    if not cfg.model.num_classes:
        raise ValueError("train.objective: 'classification' needs a classification head: set "
                         "--config.model.num_classes to the number of labels")


def _classification_shapes(cfg):
    t = cfg.train
    return {**{k: (t.batch_size, t.seq_len) for k in ("inputs", "segment_ids", "positions")},
            "labels": (t.batch_size,), "mask": (t.batch_size,)}


OBJECTIVES.register("classification", Objective(
    arch="encoder", source=_classification_source, batches=_classification_batches,
    shapes=_classification_shapes, forward=_classification_forward,
    check=_classification_check, extra=("correct",)))


# ---------------------------------------------------------- encoder-decoder
def encdec_lengths(cfg: RunConfig) -> tuple[int, int, int]:
    """(raw tokens per row, decoder length, sentinels) of span corruption; seq2seq:
    (seq_len, decoder length, 0)."""
    t = cfg.train
    if t.objective == "span_corruption":
        raw, need, spans = D.span_lengths(t.seq_len, t.noise_density, t.mean_span_length)
        return raw, t.target_len or D.round_up(need, 8), spans
    return t.seq_len, t.target_len or t.seq_len, 0


def _encdec_forward(model, b, loss_chunk=0):
    logits = model(b["encoder_inputs"], b["decoder_inputs"], b["encoder_segment_ids"],
                   b["decoder_segment_ids"], b["encoder_positions"], b["decoder_positions"])
    sums = cross_entropy_sums(logits, b["targets"], b["mask"], b["target_bytes"])
    sums["correct"] = _correct(logits, b["targets"], b["mask"])
    return sums


def _encdec_shapes(cfg):
    B, S, (_, Td, _) = cfg.train.batch_size, cfg.train.seq_len, encdec_lengths(cfg)
    return {k: (B, S if k.startswith("encoder") else Td) for k in D.ENCDEC_KEYS}


def _encdec_check(cfg, tokenizer, n_seq):
    t = cfg.train
    raw, Td, _ = encdec_lengths(cfg)
    if t.objective == "span_corruption":
        need = D.span_lengths(t.seq_len, t.noise_density, t.mean_span_length)[1]
        if Td < need:
            raise ValueError(f"train.target_len: {Td} cannot hold span corruption's targets of "
                             f"train.seq_len={t.seq_len} ({need} tokens); set it to {need} or "
                             f"more, or 0 (automatic)")
    m = cfg.model
    if m.position in ("learned", "sinusoidal") and Td > m.max_len:
        raise ValueError(f"train.target_len: the decoder length {Td} > model.max_len={m.max_len} "
                         f"(the {m.position} position table); lower it or raise max_len")
    if Td % n_seq:
        raise ValueError(f"train.target_len: the decoder length {Td} is not divisible by the "
                         f"sequence axis ({n_seq}); set --config.train.target_len to a multiple "
                         f"of {n_seq}")


def _span_batches(cfg, tokenizer, source, local_rows, train):
    t = cfg.train
    raw, Td, spans = encdec_lengths(cfg)
    return D.MappedBatches(
        _packed(cfg, tokenizer, source, local_rows, train, seq_len=raw),
        lambda b, i, rows: D.span_corruption_batch(
            b, i, rows, tokenizer=tokenizer, seed=cfg.seed, density=t.noise_density,
            mean_span=t.mean_span_length, seq_len=t.seq_len, target_len=Td,
            num_sentinels=spans))


OBJECTIVES.register("span_corruption", Objective(
    arch="encoder_decoder", source=_documents, batches=_span_batches, shapes=_encdec_shapes,
    forward=_encdec_forward, check=_encdec_check, extra=("correct",),
    specials=lambda cfg: (encdec_lengths(cfg)[2], "the sentinels")))


def _seq2seq_source(cfg, split):
    return D.read_examples(cfg.data, split, {"input": "text", "target": "text"})


def _seq2seq_batches(cfg, tokenizer, source, local_rows, train):
    t, (_, Td, _) = cfg.train, encdec_lengths(cfg)
    eos = [tokenizer.eos_id]

    def encode(ex):
        return dict(enc=np.concatenate([tokenizer.encode(ex["input"])[: t.seq_len - 1], eos]),
                    tgt=np.concatenate([tokenizer.encode(ex["target"])[: Td - 1], eos]))

    return D.ExampleBatches(
        source, encode, lambda exs: D.seq2seq_row(exs, t.seq_len, Td, tokenizer),
        global_batch=t.batch_size, local_rows=local_rows, seed=cfg.seed,
        shuffle=train and cfg.data.shuffle, repeat=train, fits=D.fits_both(t.seq_len, Td))


OBJECTIVES.register("seq2seq", Objective(
    arch="encoder_decoder", source=_seq2seq_source, batches=_seq2seq_batches,
    shapes=_encdec_shapes, forward=_encdec_forward, check=_encdec_check, extra=("correct",),
    bits_per_byte=True))


# ----------------------------------------------------------- speech_to_text
def _speech_source(cfg, split):
    return speech_examples(cfg.data, split, cfg.model.audio, seed=cfg.seed)


def _speech_batches(cfg, tokenizer, source, local_rows, train):
    return speech_batches(source, tokenizer, cfg.model.audio, target_len=encdec_lengths(cfg)[1],
                          global_batch=cfg.train.batch_size, local_rows=local_rows, seed=cfg.seed,
                          shuffle=train and cfg.data.shuffle, repeat=train)


def _speech_shapes(cfg):
    B, a, Td = cfg.train.batch_size, cfg.model.audio, encdec_lengths(cfg)[1]
    return {k: (B, a.n_mels, a.max_frames) if k == "input_features" else (B, Td)
            for k in SPEECH_KEYS}


def _speech_forward(model, b, loss_chunk=0):
    logits = model(b["decoder_inputs"], input_features=b["input_features"].astype(jnp.float32),
                   decoder_segment_ids=b["decoder_segment_ids"],
                   decoder_positions=b["decoder_positions"])
    sums = cross_entropy_sums(logits, b["targets"], b["mask"], b["target_bytes"])
    sums["correct"] = _correct(logits, b["targets"], b["mask"])
    return sums


def _speech_check(cfg, tokenizer, n_seq):
    if not cfg.model.audio.n_mels:
        raise ValueError("train.objective: 'speech_to_text' needs the audio front end: set "
                         "--config.model.audio.n_mels (80 for Whisper's features)")
    _encdec_check(cfg, tokenizer, n_seq)


OBJECTIVES.register("speech_to_text", Objective(
    arch="encoder_decoder", source=_speech_source, batches=_speech_batches,
    shapes=_speech_shapes, forward=_speech_forward, check=_speech_check, extra=("correct",),
    synthetic=True))


# --------------------------------------------------------------- preference
def _pair_batches(cfg, tokenizer, source, local_rows, train):
    t = cfg.train
    return pair_batches(encode_pairs(source, tokenizer, t.seq_len), tokenizer, seq_len=t.seq_len,
                        global_batch=t.batch_size, local_rows=local_rows, seed=cfg.seed,
                        shuffle=train and cfg.data.shuffle, repeat=train)


def _pair_shapes(cfg):
    t = cfg.train
    return {**{k: (t.batch_size, t.seq_len) for k in PAIR_KEYS}, "pairs": (t.batch_size,)}


def _pair_counts(batch, orpo=False):
    out = {"tokens": batch["pairs"].astype(jnp.float32).sum()}
    if orpo:  # every target of the chosen sequences (odd segments)
        chosen = batch["seq_mask"] * (batch["segment_ids"] % 2 == 1)
        out["sft_tokens"] = chosen.astype(jnp.float32).sum()
    return out


def preference_report(sums: dict) -> dict:
    """Pair sums -> TRL's reward metrics (means over the pairs)."""
    n = max(float(sums["tokens"]), 1.0)
    return {"rewards/chosen": sums["chosen_rewards"] / n,
            "rewards/rejected": sums["rejected_rewards"] / n,
            "rewards/accuracies": sums["wins"] / n, "rewards/margins": sums["margins"] / n}


def _preference_check(cfg, tokenizer, n_seq):
    if cfg.data.source != "jsonl":
        raise ValueError(f"data.source: train.objective={cfg.train.objective!r} reads "
                         f"{{\"prompt\", \"chosen\", \"rejected\"}} records (jsonl lines, "
                         f"parquet or datasets columns), but data.source={cfg.data.source!r}; "
                         f"set --config.data.source=jsonl and data.paths")


def _register_preference(kind):
    def bind(t):
        def forward(model, b, loss_chunk=0, reference=None):
            return pair_sums(kind, t.preference, model, b, reference, loss_chunk)
        return forward

    orpo = kind == "orpo"
    extra = ("chosen_rewards", "rejected_rewards", "wins", "margins") + (
        ("sft_nll", "sft_tokens") if orpo else ())
    OBJECTIVES.register(kind, Objective(
        arch="decoder", source=lambda cfg, split: pair_examples(cfg, split),
        batches=_pair_batches, shapes=_pair_shapes, forward=bind(TrainConfig()),
        bind=bind, check=_preference_check,
        extra=extra, terms=(("nll", "tokens"),) + ((("sft_nll", "sft_tokens"),) if orpo else ()),
        counts=lambda batch: _pair_counts(batch, orpo), report=preference_report))


for _kind in ("dpo", "ipo", "orpo", "simpo"):
    _register_preference(_kind)


# ------------------------------------------------------------------ distill
def _distill_bind(t):
    def forward(model, b, loss_chunk=0, reference=None):
        return distill_sums(model, b, reference, beta=t.distill.beta,
                            temperature=t.distill.temperature)
    return forward


OBJECTIVES.register("distill", Objective(
    arch="decoder", source=_documents, batches=_packed, shapes=_lm_shapes,
    forward=_distill_bind(TrainConfig()), bind=_distill_bind))


# --------------------------------------------------------------------- grpo
def _grpo_check(cfg, tokenizer, n_seq):
    raise ValueError("train.objective: 'grpo' trains on rollouts from the engine in its own "
                     "loop: run tfjax.train.rl.GRPOTrainer(cfg, workdir).train() (python -m "
                     "tfjax.train does), not Trainer")


# GRPO / GSPO (`tfjax.train.rl`): its record lays out the program GRPOTrainer builds (the
# model, optimizer, reference and shardings of a decoder; the step's shapes are a causal
# LM's, never run: the updates are `tfjax.train.rl.loop.make_update`); `check` sends a
# Trainer to GRPOTrainer.
OBJECTIVES.register("grpo", Objective(
    arch="decoder", source=_documents, batches=_packed, shapes=_lm_shapes,
    forward=_causal_lm_forward, check=_grpo_check))


def bound_objective(name: str, train: TrainConfig | None) -> Objective:
    """The record of `name` with its forward bound to the run's `train` section."""
    obj = OBJECTIVES.get(name, field="train.objective")
    if obj.bind is None or train is None:
        return obj
    return dataclasses.replace(obj, forward=obj.bind(train))


# ------------------------------------------------------------------- shared
def check_objective(cfg: RunConfig, tokenizer, n_seq: int = 1) -> Objective:
    """The record of `train.objective`, after its checks against the model, the
    tokenizer and the sequence shards; each error names the field and the fix."""
    t, m = cfg.train, cfg.model
    obj = OBJECTIVES.get(t.objective, field="train.objective")
    if cfg.data.source == "cache" and obj.source is not _documents:
        packing = [n for n in OBJECTIVES if OBJECTIVES.get(n).source is _documents]
        raise ValueError(f"data.source: a token cache feeds the objectives that pack documents "
                         f"({', '.join(map(repr, packing))}), not train.objective="
                         f"{t.objective!r}, which reads examples (jsonl, parquet, datasets); set "
                         f"--config.data.source=jsonl")
    if cfg.data.source == "synthetic" and not obj.synthetic:
        have = [n for n in OBJECTIVES if OBJECTIVES.get(n).synthetic]
        raise ValueError(f"data.source: 'synthetic' (shipped examples) feeds "
                         f"{', '.join(map(repr, have))}, not train.objective={t.objective!r}; "
                         f"use data.source='stdlib', 'text', 'jsonl' or 'cache'")
    if obj.arch != m.arch:
        mine = [n for n in OBJECTIVES if OBJECTIVES.get(n).arch == m.arch]
        raise ValueError(f"train.objective: {t.objective!r} trains arch={obj.arch!r} models, "
                         f"but model.arch={m.arch!r}; objectives for {m.arch!r}: "
                         f"{', '.join(map(repr, mine))}")
    count, what = obj.specials(cfg)
    need = tokenizer.vocab_size + count
    if count and m.vocab_size < need:
        raise ValueError(f"model.vocab_size: {m.vocab_size} has no room for {what} of "
                         f"train.objective={t.objective!r} ({count} id(s) from "
                         f"{tokenizer.vocab_size}, above the tokenizer's vocabulary); set "
                         f"--config.model.vocab_size={need} or more")
    obj.check(cfg, tokenizer, n_seq)
    return obj


def eval_metrics(obj: Objective, sums: dict[str, float]) -> dict[str, float]:
    """Summed eval outputs -> val_loss (nats per scored token or example), val_bpb and
    val_bytes where meaningful (`bits_per_byte`), val_accuracy where counted."""
    tokens = max(sums["tokens"], 1.0)
    if obj.terms is None:
        out = dict(val_loss=sums["nll"] / tokens)
    else:
        out = dict(val_loss=sum(sums[k] / max(sums[c], 1.0) for k, c in obj.terms))
    if obj.report is not None:
        out.update({f"val_{k}": v for k, v in obj.report(sums).items()})
    if obj.bits_per_byte:
        out.update(val_bpb=sums["nll"] / LN2 / max(sums["bytes"], 1.0), val_bytes=sums["bytes"])
    if "correct" in sums:
        out["val_accuracy"] = sums["correct"] / tokens
    return out


def eval_line(ev: dict[str, Any], final: bool) -> str:
    """The log text of an evaluation (`final`: the end-of-run line, with units)."""
    if final:
        pairs = any(k.startswith("val_rewards/") for k in ev)  # a preference loss: per pair
        parts = [f"val_loss {ev['val_loss']:.4f}{'' if pairs else ' nats/token'}"]
        if "val_bpb" in ev:
            parts.append(f"val_bpb {ev['val_bpb']:.4f} bits/byte on {int(ev['val_bytes']):,} "
                         f"validation bytes")
        if "val_accuracy" in ev:
            parts.append(f"val_accuracy {ev['val_accuracy']:.4f}")
        parts += [f"{k} {ev[k]:.4f}" for k in ev if k.startswith("val_rewards/")]
        return ", ".join(parts)
    return " ".join(f"{k} {ev[k]:.4f}" for k in ("val_loss", "val_bpb", "val_accuracy",
                                                  "val_rewards/accuracies",
                                                  "val_rewards/margins") if k in ev)
