"""What the engine is asked and what it answers: `Request` (a prompt, its sampling
settings and stop conditions, `n` samples) and `Output` (one generated token of one
sample, or its end). See docs/inference.md ("The engine").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from tfjax.inference.sampling import check_settings

__all__ = ["FINISH_REASONS", "Output", "Request"]

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
