"""Bad input gets OpenAI's error body with a 4xx status and one line of reason, and the
server answers the next request; a client that goes away (streaming or not) cancels
its request and its pages go back to the pool; a full queue is a 429."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest
from serve_fixtures import CONFIG, NAME

LONG = dict(model=NAME, prompt="hello", max_tokens=100, temperature=0, ignore_eos=True)


def post(server, path, **kw):
    return httpx.post(f"{server.url}{path}", **{"timeout": 60, **kw})


def check_error(r, status, param=None, words=""):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and "\n" not in error["message"]
    assert words in error["message"], error["message"]
    return error


def served_next(server):
    r = server.client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


COMPLETIONS = [  # (body, status, param, words in the message)
    (dict(model="gpt-4"), 404, "model", "'gpt-4' is not served here"),
    (dict(max_tokens=-1), 400, "max_tokens", "must be an integer >= 1"),
    (dict(max_tokens=0), 400, "max_tokens", ">= 1"),
    (dict(max_tokens=10_000), 400, "max_tokens", "ask for at most"),
    (dict(temperature=-0.5), 400, "temperature", "finite number >= 0"),
    (dict(top_p=0), 400, "top_p", "in (0, 1]"),
    (dict(top_p=1.5), 400, "top_p", "in (0, 1]"),
    (dict(prompt=[7] * CONFIG.max_len), 400, "prompt", "leave no room"),
    (dict(prompt=[7, 100_000]), 400, "prompt", "outside the vocabulary"),
    (dict(prompt=[[]]), 400, "prompt", "empty"),
    (dict(prompt=[]), 400, "prompt", "an empty list"),
    (dict(prompt={"a": 1}), 400, "prompt", "must be a string, a list of strings"),
    (dict(temperature="hot"), 400, "temperature", "valid number"),
    (dict(n=CONFIG.max_seqs + 1), 400, "n", "max_seqs"),
    (dict(logprobs=99), 400, "logprobs", "[0, 20]"),
    (dict(presence_penalty=3), 400, "presence_penalty", "[-2, 2]"),
    (dict(stop=[""]), 400, "stop", "empty string"),
    (dict(stop=5), 400, "stop", "a string or a list of strings"),
    (dict(echo=True), 400, "echo", "not supported"),
    (dict(logit_bias={"5": 1.0}), 400, "logit_bias", "not supported"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options", "stream=true"),
]


@pytest.mark.parametrize("body, status, param, words", COMPLETIONS,
                         ids=[f"{c[2]}-{i}" for i, c in enumerate(COMPLETIONS)])
def test_bad_completions_are_4xx_in_one_line_and_the_server_goes_on(server, body, status,
                                                                    param, words):
    r = post(server, "/v1/completions", json={"model": NAME, "prompt": "hi", **body})
    error = check_error(r, status, param, words)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    served_next(server)


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):  # a stream is refused before it starts
        server.client.completions.create(model=NAME, prompt="hi", top_p=2, stream=True)
    served_next(server)


@pytest.mark.parametrize("content, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"", None, "the request body"),
    (b'{"prompt": "hi", "max_tokens": 2', None, "not valid JSON"),
    (b'{"model": "tiny-llama"}', "prompt", "prompt: Field required"),
])
def test_invalid_json_is_a_400_not_fastapis_422(server, content, param, words):
    r = post(server, "/v1/completions", content=content,
             headers={"content-type": "application/json"})
    check_error(r, 400, param, words)
    served_next(server)


CHATS = [
    (dict(messages=[]), 400, "messages", "empty"),
    (dict(messages=[{"content": "hi"}]), 400, "messages", "messages.0.role: Field required"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages",
     "only text parts"),
    (dict(top_logprobs=2), 400, "top_logprobs", "logprobs=true"),
    (dict(logprobs=True, top_logprobs=50), 400, "top_logprobs", "[0, 20]"),
    (dict(max_completion_tokens=1000), 400, "max_tokens", "ask for at most"),
    (dict(messages=[{"role": "user", "content": "hi " * 200}]), 400, "messages",
     "leave no room"),
    (dict(tools=[{"type": "function"}]), 400, "tools", "not supported"),
    (dict(response_format={"type": "json_object"}), 400, "response_format", "not supported"),
    (dict(model="other"), 404, "model", "not served here"),
]


@pytest.mark.parametrize("body, status, param, words", CHATS,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(CHATS)])
def test_bad_chats_are_4xx_in_one_line(server, body, status, param, words):
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", json={"model": NAME, "messages": messages, **body})
    check_error(r, status, param, words)


def test_unknown_routes_and_methods_have_the_error_shape(server):
    check_error(httpx.get(f"{server.url}/v1/nothing"), 404, None, "Not Found")
    check_error(httpx.get(f"{server.url}/v1/completions"), 405, None, "Method Not Allowed")


def wait_idle(server, cancelled_before, timeout=30):
    deadline = time.monotonic() + timeout
    loop = server.served.loop
    while time.monotonic() < deadline:
        if (loop.counts["cancelled"] > cancelled_before and server.engine.pages_in_use() == 0
                and not server.engine.has_work()):
            return
        time.sleep(0.02)
    raise AssertionError(f"not idle: {server.engine.pages_in_use()} pages in use, "
                         f"{dict(loop.counts)}")


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Each engine step takes 20 ms more: a 100-token answer lasts 2 s."""
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.02), step())[1])


def test_a_client_that_leaves_a_stream_cancels_it(server, slow_steps):
    before = server.served.loop.counts["cancelled"]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json=dict(LONG, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first chunk: the request runs; leave
        assert server.engine.pages_in_use() > 0
    wait_idle(server, before)
    served_next(server)


def test_a_client_that_leaves_before_the_answer_cancels_it(server, slow_steps):
    before = server.served.loop.counts["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=0.5))
    wait_idle(server, before)
    served_next(server)


def test_a_full_queue_is_a_429_and_the_queued_requests_finish(server, monkeypatch):
    gate, step = threading.Event(), server.engine.step

    def held_step():
        gate.wait()
        return step()

    monkeypatch.setattr(server.engine, "step", held_step)
    monkeypatch.setattr(server.served.loop, "max_queue", 2)
    ask = lambda: server.client.completions.create(model=NAME, prompt="a b", max_tokens=3,  # noqa
                                                   temperature=0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            queued = [pool.submit(ask) for _ in range(2)]
            deadline = time.monotonic() + 30
            while server.engine.queued() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = post(server, "/v1/completions", timeout=10,
                     json=dict(model=NAME, prompt="hi", max_tokens=2))
            check_error(r, 429, None, "--max_queue 2")
            assert r.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                server.client.with_options(timeout=10).completions.create(model=NAME,
                                                                          prompt="a")
        finally:
            gate.set()
        assert all(f.result(timeout=60).choices[0].text is not None for f in queued)
    monkeypatch.undo()
    served_next(server)
    assert server.engine.pages_in_use() == 0
