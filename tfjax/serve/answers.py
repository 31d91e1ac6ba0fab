"""OpenAI's answers from the engine's outputs: a `Job` (one API call: a request per
prompt, `n` samples each, choice i*n + j) runs (`Run`) as a stream of `Delta`s (the new
text of a sample, the tokens that came with it, its end), written as server-sent
events (`events`) or as one answer (`answer`), in the completions or the chat format,
with logprobs and usage. A run whose reader goes away cancels its unfinished requests.
See docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

from tfjax.inference.engine import Request
from tfjax.serve.detokenize import SampleText
from tfjax.serve.protocol import APIError
from tfjax.serve.served import Served

__all__ = ["Delta", "Job", "Run", "answer", "events"]


@dataclasses.dataclass
class Job:
    """kind: "completion" or "chat". logprobs: the top tokens to report at each step
    (None: no logprobs)."""

    kind: str
    id: str
    created: int
    model: str
    requests: list[Request]
    logprobs: int | None = None
    include_usage: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


@dataclasses.dataclass
class Delta:
    """What one step added to choice `index`: `text` and the `tokens` that came with it
    ((id, logprob, {id: logprob} of the top ones, offset of its text in the answer))."""

    index: int
    text: str
    tokens: list
    finish_reason: str | None = None


class Run:
    """`job` submitted to the engine loop now (QueueFull, or the engine's ValueError);
    iterate it for its deltas step by step until every sample ended. `close()` (also
    when the reader stops early) cancels what is unfinished: its pages free at once."""

    def __init__(self, served: Served, job: Job):
        self.served, self.job = served, job
        self.queue = served.loop.submit(job.requests)
        self.base, self.texts, self.live = {}, {}, {}
        for i, r in enumerate(job.requests):
            self.base[r.request_id] = i * r.n
            self.live[r.request_id] = set(range(r.n))
            for j in range(r.n):
                self.texts[i * r.n + j] = SampleText(served.decode, r.prompt, r.stop)

    async def __aiter__(self) -> AsyncIterator[list[Delta]]:
        try:
            while self.live:
                outputs = await self.queue.get()
                if isinstance(outputs, BaseException):
                    raise APIError(500, f"the engine failed: {type(outputs).__name__}: "
                                   f"{outputs}")
                yield [d for o in outputs if (d := self._delta(o)) is not None]
        finally:
            self.close()

    def _delta(self, o) -> Delta | None:
        if o.index not in self.live.get(o.request_id, ()):
            return None
        index = self.base[o.request_id] + o.index
        text = self.texts[index]
        offset = len(text.text)
        final = o.finish_reason is not None
        piece = text.add(o.token, final=final, stopped=o.stop_string is not None)
        tokens = [] if o.token is None else [(o.token, o.logprob, o.top_logprobs, offset)]
        if final:
            self.live[o.request_id].discard(o.index)
            if not self.live[o.request_id]:
                del self.live[o.request_id]
                self.served.loop.release([o.request_id])
        return Delta(index, piece, tokens, o.finish_reason)

    def close(self) -> None:
        if self.live:
            self.served.loop.cancel(list(self.live))
            self.live = {}


# --------------------------------------------------------------------- formats
def _usage(job: Job, completion_tokens: int) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens}


def _logprobs(served: Served, job: Job, tokens: list):
    """The logprobs of `tokens` in the job's format (None without logprobs)."""
    if job.logprobs is None:
        return None
    text = lambda t: served.decode([t])  # noqa: E731
    if job.kind == "chat":
        entry = lambda t, lp: {"token": text(t), "logprob": lp,  # noqa: E731
                               "bytes": list(text(t).encode())}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(u, q) for u, q in
                                                             (top or {}).items()])
                            for t, lp, top, _ in tokens]}
    return {"tokens": [text(t) for t, *_ in tokens],
            "token_logprobs": [lp for _, lp, _, _ in tokens],
            "top_logprobs": [{text(u): q for u, q in (top or {}).items()}
                             for _, _, top, _ in tokens],
            "text_offset": [offset for *_, offset in tokens]}


def _head(job: Job, chunk: bool) -> dict:
    kind = {"completion": "text_completion", "chat": "chat.completion"}[job.kind]
    return {"id": job.id, "object": kind + (".chunk" if chunk and job.kind == "chat" else ""),
            "created": job.created, "model": job.model}


def _chunk(job: Job, choices: list[dict]) -> str:
    body = dict(_head(job, True), choices=choices)
    if job.include_usage:
        body["usage"] = None
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def events(run: Run):
    """The job as server-sent events: a chunk per step and choice with new text (or
    tokens, with logprobs; or its end), the usage chunk if asked, `data: [DONE]`."""
    served, job, generated = run.served, run.job, 0
    try:
        if job.kind == "chat":
            n = sum(r.n for r in job.requests)
            yield _chunk(job, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None} for i in range(n)])
        async for batch in run:
            choices = []
            for d in batch:
                generated += len(d.tokens)
                if not d.text and d.finish_reason is None and (job.logprobs is None
                                                               or not d.tokens):
                    continue
                choice = {"index": d.index, "logprobs": _logprobs(served, job, d.tokens),
                          "finish_reason": d.finish_reason}
                if job.kind == "chat":
                    choice["delta"] = {"content": d.text} if d.text else {}
                else:
                    choice["text"] = d.text
                choices.append(choice)
            if choices:
                yield _chunk(job, choices)
        if job.include_usage:
            body = dict(_head(job, True), choices=[], usage=_usage(job, generated))
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    except APIError as e:  # the status line is sent: the error goes in the stream
        yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def answer(run: Run) -> dict:
    """The job's whole answer."""
    served, job = run.served, run.job
    n = sum(r.n for r in job.requests)
    text, tokens, reasons = [""] * n, [[] for _ in range(n)], [None] * n
    async for batch in run:
        for d in batch:
            text[d.index] += d.text
            tokens[d.index] += d.tokens
            reasons[d.index] = d.finish_reason or reasons[d.index]
    choices = []
    for i in range(n):
        choice = {"index": i, "logprobs": _logprobs(served, job, tokens[i]),
                  "finish_reason": reasons[i]}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text[i]}
        else:
            choice["text"] = text[i]
        choices.append(choice)
    return dict(_head(job, False), choices=choices,
                usage=_usage(job, sum(len(t) for t in tokens)))
