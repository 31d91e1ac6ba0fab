"""The engine loop on a stand-in engine: it sleeps without work and wakes on a submit,
delivers each step's outputs to the queue of their request, bounds the waiting
requests, and an engine that raises reaches every listener and is not stepped again."""

from __future__ import annotations

import asyncio
import collections

import pytest

from tfjax.inference.engine import Output, Request
from tfjax.serve.loop import EngineLoop, QueueFull


class StandIn:
    """Each submitted request gets one token per step, `steps` tokens in all."""

    def __init__(self, steps=2, fail_at=None):
        self.steps, self.fail_at, self.calls = steps, fail_at, 0
        self.waiting, self.running = collections.deque(), {}

    def submit(self, r):
        if r.max_tokens < 1:
            raise ValueError("max_tokens: must be an integer >= 1")
        self.waiting.append(r.request_id)
        return r.request_id

    def cancel(self, rid):
        self.running.pop(rid, None)

    def queued(self):
        return len(self.waiting)

    def has_work(self):
        return bool(self.waiting or self.running)

    def step(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        while self.waiting:
            self.running[self.waiting.popleft()] = 0
        out = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.steps
            out.append(Output(rid, 0, self.running[rid], finish_reason="length" if done
                              else None))
            if done:
                del self.running[rid]
        return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_outputs_reach_their_request_and_the_loop_sleeps_between():
    engine = StandIn(steps=3)
    loop = EngineLoop(engine, max_queue=4)
    loop.start()

    async def main():
        a = loop.submit([Request([1], request_id="a")])
        b = loop.submit([Request([1], request_id="b"), Request([2], request_id="c")])
        got = collections.defaultdict(list)
        for q, ids in ((a, {"a"}), (b, {"b", "c"})):
            while sum(len(got[i]) for i in ids) < 3 * len(ids):
                for o in await q.get():
                    got[o.request_id].append(o.token)
        calls = engine.calls
        await asyncio.sleep(0.1)
        assert engine.calls == calls  # no work: no steps
        d = loop.submit([Request([1], request_id="d")])  # wakes the loop
        while len(got["d"]) < 3:
            got["d"] += [o.token for o in await d.get()]
        return got

    try:
        got = run(main())
    finally:
        loop.close()
    assert dict(got) == {k: [1, 2, 3] for k in "abcd"}


def test_the_queue_bound_and_a_bad_request_refuse_all_or_none():
    engine = StandIn()
    loop = EngineLoop(engine, max_queue=3)  # not started: requests stay queued

    async def main():
        loop.submit([Request([1], request_id="a")])
        with pytest.raises(QueueFull, match=r"1 requests wait for a slot \(--max_queue 3\)"):
            loop.submit([Request([1]), Request([2]), Request([3])])
        with pytest.raises(ValueError, match="max_tokens"):
            loop.submit([Request([1], request_id="b"), Request([1], max_tokens=0)])

    run(main())
    assert list(engine.waiting) == ["a", "b"] and loop.counts["cancelled"] == 1  # b undone
    with pytest.raises(ValueError, match="--max_queue: must be >= 1"):
        EngineLoop(engine, max_queue=0)


def test_an_engine_that_raises_reaches_every_listener_and_stops():
    engine = StandIn(steps=5, fail_at=2)
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        q = loop.submit([Request([1], request_id="a")])
        first = await q.get()
        error = await q.get()
        return first, error

    try:
        first, error = run(main())
    finally:
        loop.close()
    assert [o.token for o in first] == [1]
    assert isinstance(error, RuntimeError) and loop.failure is error and engine.calls == 2

    async def again():
        loop.submit([Request([1])])

    with pytest.raises(RuntimeError, match="the engine stopped: boom"):
        run(again())
