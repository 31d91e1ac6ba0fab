"""What the engine is asked and what it answers: `Request` (a prompt, its sampling
settings and stop conditions, `n` samples) and `Output` (one generated token of one
sample, or its end); the engine's record of a sample in a slot, `SequenceState` (and a
`Placeholder` for a sample not forked yet). See docs/inference.md ("The engine").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from tfjax.inference.sampling import check_settings

__all__ = ["FINISH_REASONS", "Output", "Placeholder", "Request", "SequenceState"]

FINISH_REASONS = ("stop", "length", "abort")
_ids = itertools.count()


@dataclasses.dataclass
class Request:
    """One prompt to complete.

    prompt: token ids (at least one). max_tokens: the most tokens each sample
    generates (the engine's `max_len` also bounds prompt + output). n: samples of the
    prompt (they share its pages). sampling: the settings of
    `tfjax.inference.sampling.check_settings` (temperature, top_k, top_p, min_p, the
    penalties, seed; sample i of n draws with its own seed derived from it). stop:
    strings that end a sample once its text contains one (needs the engine's
    `decode`); stop_token_ids: tokens that end it; ignore_eos: the engine's EOS tokens
    do not. logprobs: how many most likely tokens to report with each token (0: only
    the chosen token's log-probability). score_from: k >= 1 reports the
    log-probability of each prompt token from position k on given the tokens before
    it, and whether it is the greedy choice (lm-eval's loglikelihood), with the
    prompt's first output; then `max_tokens` may be 0 (score only). One sample.
    """

    prompt: Sequence[int]
    max_tokens: int = 16
    n: int = 1
    sampling: Mapping = dataclasses.field(default_factory=dict)
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    score_from: int = 0
    request_id: str = ""

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        self.prompt = [int(t) for t in self.prompt]
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def pages_needed(self, page_size: int, max_len: int) -> tuple[int, int, int, int]:
        """(tokens to cache before the first sample, pages of one sample, full prompt
        pages its n samples share, pages of all n at their longest)."""
        L = len(self.prompt)
        # n > 1: the last prompt token is each sample's own first step; scoring
        # only (max_tokens 0): its logits are not needed
        target = L - 1 if self.n > 1 or not self.max_tokens else L
        per_seq = -(-min(L + self.max_tokens, max_len) // page_size)
        shared = target // page_size if self.n > 1 else 0  # the leader's full pages
        return target, per_seq, shared, per_seq + (self.n - 1) * (per_seq - shared)

    def check(self, *, max_len: int, vocab_size: int, max_logprobs: int) -> dict:
        """Raise a one-line ValueError naming the field when the request cannot be served
        (a server's HTTP 400); else its checked sampling settings."""
        where = f" (request {self.request_id})"
        if not self.prompt:
            raise ValueError(f"prompt: empty{where}; give at least one token")
        bad = [t for t in self.prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary [0, {vocab_size})"
                             f"{where}")
        if len(self.prompt) > max_len or (len(self.prompt) == max_len and self.max_tokens):
            raise ValueError(f"prompt: {len(self.prompt)} tokens leave no room to generate in "
                             f"the engine's max_len={max_len}{where}; shorten the prompt")
        if not isinstance(self.score_from, int) or not 0 <= self.score_from < len(self.prompt):
            raise ValueError(f"score_from: must be an integer in [0, {len(self.prompt)}) (a "
                             f"prompt position; 0: off), got {self.score_from!r}{where}")
        least = 0 if self.score_from else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise ValueError(f"max_tokens: must be an integer >= {least}, got "
                             f"{self.max_tokens!r}{where}")
        if self.score_from and self.n != 1:
            raise ValueError(f"n: a scored prompt (score_from) takes one sample, got "
                             f"{self.n}{where}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n: must be an integer >= 1, got {self.n!r}{where}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs: must be an integer in [0, {max_logprobs}], got "
                             f"{self.logprobs!r}{where}")
        return check_settings(dict(self.sampling), where)


@dataclasses.dataclass
class Output:
    """One step of one sample: `token` (None when the sample ended without a new token,
    e.g. aborted), its `logprob` and `top_logprobs` ({token: logprob} of the most
    likely `request.logprobs` tokens), and `finish_reason` ("stop", "length", "abort"
    or None while it goes on; `stop_string` is the string that stopped it). A request
    with `score_from` gets `prompt_logprobs` and `prompt_greedy` (lists over prompt
    positions score_from..) with its first output."""

    request_id: str
    index: int
    token: int | None
    logprob: float | None = None
    top_logprobs: dict | None = None
    finish_reason: str | None = None
    stop_string: str | None = None
    prompt_logprobs: list | None = None
    prompt_greedy: list | None = None


@dataclasses.dataclass
class SequenceState:
    """One sample of a request, in the engine's slot `slot` (the engine's own record)."""

    request: Request
    index: int
    slot: int
    settings: dict
    tokens: list  # prompt, then the generated tokens
    prompt_len: int
    target: int  # the tokens to put in the cache before the first sample (prompt or n-1)
    computed: int = 0  # tokens in the cache (or on their way: dispatched)
    dispatched: int = 0  # samples dispatched (read or not)
    unread: int = 0  # calls dispatched with it and not read yet
    pages: list = dataclasses.field(default_factory=list)  # global page ids, logical order
    worst: int = 0  # the most global pages it can come to hold
    registered: int = 0  # its full prompt pages already in the prefix cache
    hashes: list = dataclasses.field(default_factory=list)
    followers: list = dataclasses.field(default_factory=list)  # slots waiting for a fork
    fresh: bool = True  # its slot's rows still hold the previous sequence's state
    scores: list = dataclasses.field(default_factory=list)  # (logprob, greedy) per position

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def next_token(self) -> int:
        """The next input token, or -1 for a sample not read yet (a step takes it from
        the device: `programs.drawn`)."""
        return self.tokens[self.computed] if self.computed < len(self.tokens) else -1

    def spent(self, max_len: int) -> bool:
        """Whether its dispatched samples reach `max_tokens` or `max_len` (no more)."""
        return (self.dispatched >= self.request.max_tokens
                or self.prompt_len + self.dispatched >= max_len)

    def append(self, token: int, eos_ids, decode, max_len: int) -> tuple:
        """Append a drawn `token`: (None, None) if the sample goes on, else its finish
        reason ("stop" at a stop token, an EOS unless ignored, or a stop string in the
        text `decode` gives; "length" at `max_tokens` or `max_len`) and stop string."""
        self.tokens.append(token)
        r, reason, stop_string = self.request, None, None
        if token in r.stop_token_ids or (token in eos_ids and not r.ignore_eos):
            reason = "stop"
        elif r.stop and decode is not None:
            text = decode(self.tokens[self.prompt_len:])
            stop_string = next((x for x in r.stop if x in text), None)
            reason = "stop" if stop_string is not None else None
        if reason is None and (self.generated >= r.max_tokens or len(self.tokens) >= max_len):
            reason = "length"
        return reason, stop_string

    def output(self, sampled, i: int, eos_ids, decode, max_len: int) -> Output:
        """The `Output` of the token it drew (row i of `sampled`, appended; a finish
        reason if it ends the sample)."""
        token, top, k = int(sampled.tokens[i]), None, self.request.logprobs
        if k:
            top = {int(t): float(p) for t, p in zip(sampled.top_ids[i][:k],
                                                     sampled.top_logprobs[i][:k])}
        reason, stop_string = self.append(token, eos_ids, decode, max_len)
        out = Output(self.request.request_id, self.index, token, float(sampled.logprobs[i]),
                     top, reason, stop_string)
        return self.scored(out) if self.generated == 1 else out

    def scored(self, output: Output) -> Output:
        """`output` with the prompt's scores of a request with `score_from`."""
        if self.request.score_from and output.prompt_logprobs is None:
            output.prompt_logprobs = [lp for lp, _ in self.scores]
            output.prompt_greedy = [g for _, g in self.scores]
        return output


class Placeholder:
    """A slot reserved for a follower of `leader` (a sample not forked yet)."""

    def __init__(self, leader: SequenceState, worst: int):
        self.leader, self.request, self.worst, self.pages = leader, leader.request, worst, []
