"""The HTTP side: a FastAPI app with OpenAI's endpoints over a `Served` model
(`create_app`): `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`. Every bad input is a 4xx with OpenAI's error body, raised
before anything runs (FastAPI's 422 becomes OpenAI's 400); a full queue is a 429; a
client that goes away, streaming or not, cancels its requests. The app starts and stops
the engine loop's thread with its lifespan. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from tfjax.inference.engine import Request
from tfjax.serve.answers import Job, Run, answer, events
from tfjax.serve.loop import QueueFull
from tfjax.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                  error_body)
from tfjax.serve.served import Served

__all__ = ["create_app"]

router = fastapi.APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the context left


def create_app(served: Served) -> fastapi.FastAPI:
    """The server's app; its lifespan starts and stops `served.loop`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.loop.start()
        try:
            yield
        finally:
            served.loop.close()

    app = fastapi.FastAPI(title="tfjax.serve", lifespan=lifespan)
    app.state.served = served
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
    return app


# ---------------------------------------------------------------------- errors
async def _api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


_UNION_TAG = re.compile(r"\[|^(str|int|float|bool|dict|list)$")


async def _invalid(request, e: RequestValidationError):
    """FastAPI's 422 as OpenAI's 400: the first problem, with the field it is in."""
    err = e.errors()[0] if e.errors() else {"type": "", "msg": "invalid", "loc": ()}
    if err["type"] == "json_invalid":
        return JSONResponse(error_body(400, f"the request body is not valid JSON "
                                            f"({err.get('ctx', {}).get('error', err['msg'])}); "
                                            f"send a JSON object"), status_code=400)
    loc = [str(x) for x in err.get("loc", ()) if not _UNION_TAG.search(str(x))]
    loc = loc[1:] if loc and loc[0] == "body" else loc
    where = ".".join(loc) or "the request body"
    message = f"{where}: {err['msg']}"
    if loc and loc[0] in _UNIONS and err["type"] != "missing":  # an error per accepted type
        message = f"{loc[0]}: must be {_UNIONS[loc[0]]}"
    return JSONResponse(error_body(400, message, loc[0] if loc else None), status_code=400)


_UNIONS = {"prompt": "a string, a list of strings, a list of token ids or a list of lists "
                     "of token ids",
           "stop": "a string or a list of strings"}


async def _http_error(request, e: HTTPException):
    return JSONResponse(error_body(e.status_code, f"{request.url.path}: {e.detail}"),
                        status_code=e.status_code, headers=getattr(e, "headers", None))


async def _internal(request, e: Exception):
    return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"),
                        status_code=500)


def _param(message: str, fields, renames=None) -> str | None:
    """The request field an engine message names (it starts with it)."""
    m = re.match(r"(\w+)", message)
    name = m.group(1) if m else None
    name = (renames or {}).get(name, name)
    return name if name in fields else None


# ---------------------------------------------------------------------- routes
@router.get("/health")
async def health(request: fastapi.Request):
    loop = _served(request).loop
    if loop.failure is not None:
        return JSONResponse(error_body(503, f"the engine stopped: {loop.failure}"),
                            status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: fastapi.Request):
    served = _served(request)
    return {"object": "list", "data": [{"id": served.name, "object": "model",
                                        "created": served.created, "owned_by": "tfjax",
                                        "max_model_len": served.max_len}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: fastapi.Request):
    served = _served(request)
    _check(served, body)
    prompts = _prompts(served, body.prompt)
    job = Job("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), served.name, [],
              logprobs=body.logprobs, include_usage=_usage(body))
    job.requests = [_request(served, body, ids, f"{job.id}-{i}", body.max_tokens,
                             DEFAULT_MAX_TOKENS, "prompt", body.logprobs or 0)
                    for i, ids in enumerate(prompts)]
    return await _respond(request, served, job, body.stream,
                          fields=CompletionRequest.model_fields)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
    served = _served(request)
    _check(served, body)
    if served.chat is None:
        raise APIError(400, served.no_chat, param="messages")
    if not body.messages:
        raise APIError(400, "messages: empty; give at least one message", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    try:
        text = served.chat(messages)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    ids = served.encode(text, False)  # the template writes the special tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served.name, [],
              logprobs=logprobs, include_usage=_usage(body))
    job.requests = [_request(served, body, ids, job.id, body.limit(), None, "messages",
                             logprobs or 0)]
    return await _respond(request, served, job, body.stream,
                          fields=ChatCompletionRequest.model_fields,
                          renames={"prompt": "messages", "logprobs": "top_logprobs"})


# --------------------------------------------------------------------- helpers
def _served(request: fastapi.Request) -> Served:
    return request.app.state.served


def _check(served: Served, body) -> None:
    if body.model is not None and body.model != served.name:
        raise APIError(404, f"model: {body.model!r} is not served here; this server serves "
                       f"{served.name!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    body.check_supported()


def _usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _prompts(served: Served, prompt) -> list[list[int]]:
    """`prompt` (a string, token ids, or a list of either) as token id lists; a string
    with the special tokens a document begins with (BOS), as transformers encodes it."""
    if isinstance(prompt, str):
        return [served.encode(prompt, True)]
    if not prompt:
        raise APIError(400, "prompt: an empty list; give a string or token ids",
                       param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    out = [served.encode(p, True) if isinstance(p, str) else list(p) for p in prompt]
    if len(out) > served.loop.max_queue:
        raise APIError(400, f"prompt: {len(out)} prompts in one request exceed the server's "
                       f"queue of {served.loop.max_queue} (--max_queue); send fewer",
                       param="prompt")
    return out


def _request(served: Served, body, ids: list[int], request_id: str, limit, default,
             field: str, logprobs: int) -> Request:
    """An engine request for prompt `ids`; `limit`: the max_tokens asked (None:
    `default`, or the context left)."""
    room = served.max_len - len(ids)
    if room < 1:
        raise APIError(400, f"{field}: {len(ids)} tokens leave no room to generate in the "
                       f"context of {served.max_len} tokens; shorten the {field}",
                       param=field, code="context_length_exceeded")
    if limit is None:
        limit = min(default or room, room)
    elif isinstance(limit, int) and limit > room:
        raise APIError(400, f"max_tokens: {limit} and the {len(ids)} tokens of the {field} "
                       f"exceed the context of {served.max_len} tokens; ask for at most "
                       f"{room}", param="max_tokens", code="context_length_exceeded")
    return Request(ids, max_tokens=limit, n=body.n, sampling=body.sampling(),
                   stop=body.stops(), stop_token_ids=body.stop_token_ids or (),
                   ignore_eos=body.ignore_eos, logprobs=logprobs, request_id=request_id)


async def _respond(request: fastapi.Request, served: Served, job: Job, stream: bool, *,
                   fields, renames=None):
    """Submit `job`; its events, or its answer unless the client went away first."""
    try:
        run = Run(served, job)
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full") from None
    except ValueError as e:
        raise APIError(400, str(e), param=_param(str(e), fields, renames)) from None
    except RuntimeError as e:
        raise APIError(503, str(e)) from None
    if stream:
        return StreamingResponse(events(run), media_type="text/event-stream",
                                 background=BackgroundTask(run.close))
    try:
        body = await _unless_disconnected(request, answer(run))
    finally:
        run.close()
    return Response(status_code=499) if body is None else JSONResponse(body)


async def _unless_disconnected(request: fastapi.Request, work):
    """The result of coroutine `work`, or None (and `work` cancelled) if the client
    disconnects first."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None if task.cancelled() else task.result()
