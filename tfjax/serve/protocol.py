"""OpenAI's wire format as the server reads it: the bodies of `/v1/completions` and
`/v1/chat/completions` (pydantic models: a wrong type is an HTTP 400 naming the field),
the fields it does not support (refused by name, never ignored silently), and the error
body `{"error": {"message", "type", "param", "code"}}` (`APIError`). See
docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "StreamOptions", "error_body"]

_TYPES = {429: "rate_limit_error", 404: "not_found_error"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: one line of reason, the request field it is about."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": " ".join(str(message).split("\n")), "type": kind,
                      "param": param, "code": code}}


class APIError(Exception):
    """An answer of HTTP `status` with OpenAI's error body (`error_body`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.code)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None  # vLLM's extras from here on
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def sampling(self) -> dict:
        """The engine's sampling settings (`tfjax.inference.sampling.check_settings`
        checks them); top_k -1 is vLLM's "off", 0 here."""
        out = {k: getattr(self, k) for k in ("temperature", "top_p", "min_p",
                                              "presence_penalty", "frequency_penalty",
                                              "repetition_penalty", "seed")}
        out["top_k"] = 0 if self.top_k == -1 else self.top_k
        return {k: v for k, v in out.items() if v is not None}

    def stops(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stop:
            raise APIError(400, "stop: an empty string would stop every answer at once; "
                           "drop it", param="stop")
        return stop

    def check_supported(self) -> None:
        """Refuse fields that would change the answer and are not implemented."""
        if self.logit_bias:
            _unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream=true", param="stream_options")
        for name in self._unsupported_fields():
            _unsupported(name)

    def _unsupported_fields(self) -> list[str]:
        return []


def _unsupported(name: str):
    raise APIError(400, f"{name}: not supported by this server (tfjax.serve); leave it out "
                   f"(see docs/serving.md, what is not supported)", param=name)


class CompletionRequest(_Generation):
    """`POST /v1/completions`: `prompt` is a string, token ids, or a list of either (one
    answer, or `n`, per prompt); `logprobs` k: the k most likely tokens at each step."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported_fields(self) -> list[str]:
        return ([n for n in ("echo", "suffix") if getattr(self, n)]
                + (["best_of"] if self.best_of not in (None, self.n) else []))


class ChatMessage(BaseModel):
    """One message: a role and its content (a string, or a list of text parts)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self, i: int) -> dict:
        """The message as chat templates read it: content a string (text parts joined
        by newlines, as vLLM's "string" content format)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts "
                                   f'({{"type": "text", "text": ...}}) are supported, got '
                                   f"{part.get('type')!r}", param="messages")
                parts.append(part["text"])
            out["content"] = "\n".join(parts)
        return out


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions`: `messages` rendered with the checkpoint's chat
    template; `max_completion_tokens` (or the older `max_tokens`); `logprobs` true with
    `top_logprobs` k."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def _unsupported_fields(self) -> list[str]:
        out = [n for n in ("tools", "functions") if getattr(self, n)]
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append("response_format")
        return out

    def limit(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None \
            else self.max_completion_tokens
