"""A bounded load test: 200 requests of mixed lengths (completions and chats, streamed or
not, n of 1 or 2), 32 at a time on 4 slots, within a time limit: no error, and every
page back in the pool afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
from serve_fixtures import NAME

REQUESTS, AT_ONCE, LIMIT_S = 200, 32, 300


def ask(server, i: int):
    rng = np.random.default_rng(i)
    kw = dict(model=NAME, max_tokens=int(rng.integers(1, 40)), n=int(rng.integers(1, 3)),
              temperature=float(rng.choice([0.0, 0.8])), seed=i, timeout=LIMIT_S)
    stream = bool(rng.integers(0, 2))
    words = " ".join(rng.choice(["hello", "world", "fox", "東京", "a"], rng.integers(1, 12)))
    if i % 5 == 0:
        r = server.client.chat.completions.create(
            messages=[{"role": "user", "content": words}], stream=stream, **kw)
        get = lambda c: c.delta.content if stream else c.message.content  # noqa: E731
    else:
        prompt = rng.integers(0, 300, rng.integers(1, 60)).tolist() if i % 2 else words
        r = server.client.completions.create(prompt=prompt, stream=stream, **kw)
        get = lambda c: c.text  # noqa: E731
    texts, ended = {}, set()
    for chunk in (r if stream else [r]):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (get(c) or "")
            if c.finish_reason is not None:
                ended.add(c.index)
    assert ended == set(range(kw["n"])), (i, ended)
    return texts


@pytest.mark.slow  # ~20 s on 2 cores
def test_200_mixed_requests_32_at_a_time(server):
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        futures = [pool.submit(ask, server, i) for i in range(REQUESTS)]
        done, late = concurrent.futures.wait(futures, timeout=LIMIT_S)
        for f in late:
            f.cancel()
    assert not late, f"{len(late)} requests unanswered after {LIMIT_S} s"
    errors = [f.exception() for f in done if f.exception() is not None]
    assert not errors, errors[:3]
    deadline = time.monotonic() + 10
    while server.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine.pages_in_use() == 0 and not server.engine.has_work()
    assert server.engine.queued() == 0
    print(f"{REQUESTS} requests in {time.monotonic() - start:.1f} s")
