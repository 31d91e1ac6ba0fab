"""The engine's loop: one thread steps `tfjax.inference.engine.Engine` while it has work
and sleeps on an event otherwise; each step's outputs go to the asyncio queue of the
request they belong to (`loop.call_soon_threadsafe`). Submitting and cancelling happen
on the server's event loop; requests waiting for a slot are bounded (`max_queue`: a
full queue is `QueueFull`, HTTP 429). An engine that raises is not stepped again: its
requests get the error and the server reports itself unhealthy. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

from tfjax.inference.engine import Engine, Request

__all__ = ["EngineLoop", "QueueFull"]

log = logging.getLogger("tfjax.serve")


class QueueFull(Exception):
    """More requests wait for a slot than the server's `max_queue`."""


class EngineLoop:
    """`submit(requests)` -> an asyncio queue of `[Output]` lists (or the exception that
    stopped the engine); `cancel(ids)`; `start()` / `close()` the thread."""

    def __init__(self, engine: Engine, max_queue: int = 128):
        if max_queue < 1:
            raise ValueError(f"--max_queue: must be >= 1 (requests that may wait for a "
                             f"slot), got {max_queue}")
        self.engine, self.max_queue = engine, max_queue
        self.failure: BaseException | None = None
        self.counts = collections.Counter()  # submitted, finished, cancelled, refused
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------ the event loop's side
    def submit(self, requests: list[Request]) -> asyncio.Queue:
        """Queue `requests` (all or none): raises QueueFull, or the engine's one-line
        ValueError for a bad request. Call from the event loop that reads the queue."""
        if self.failure is not None:
            raise RuntimeError(f"the engine stopped: {self.failure}")
        waiting = self.engine.queued()
        if waiting + len(requests) > self.max_queue:
            self.counts["refused"] += 1
            raise QueueFull(f"{waiting} requests wait for a slot (--max_queue "
                            f"{self.max_queue}); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            self._listeners.update((r.request_id, (loop, queue)) for r in requests)
        done = []
        try:
            for r in requests:
                done.append(self.engine.submit(r))
        except BaseException:
            self.cancel([r.request_id for r in requests], submitted=done)
            raise
        self.counts["submitted"] += len(requests)
        self._wake.set()
        return queue

    def cancel(self, request_ids, *, submitted=None) -> None:
        """Stop listening to `request_ids` and cancel those the engine has (`submitted`:
        those of them it was given; default all): their pages free at the next step."""
        with self._lock:
            for rid in request_ids:
                self._listeners.pop(rid, None)
        for rid in request_ids if submitted is None else submitted:
            self.engine.cancel(rid)
            self.counts["cancelled"] += 1
        self._wake.set()

    def release(self, request_ids) -> None:
        """Stop listening to finished `request_ids`."""
        with self._lock:
            for rid in request_ids:
                if self._listeners.pop(rid, None) is not None:
                    self.counts["finished"] += 1

    # ------------------------------------------------------------ the thread
    def start(self) -> None:
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tfjax-engine-loop",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._closing:
            self._wake.clear()
            if not self.engine.has_work():
                self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - every listener must hear of it
                log.exception("the engine failed; it will not be stepped again")
                self.failure = e
                with self._lock:
                    listeners, self._listeners = list(self._listeners.values()), {}
                for loop, queue in listeners:
                    _deliver(loop, queue, e)
                return
            by_request = collections.defaultdict(list)
            for o in outputs:
                by_request[o.request_id].append(o)
            with self._lock:
                targets = [(self._listeners.get(rid), outs) for rid, outs in by_request.items()]
            for target, outs in targets:
                if target is not None:
                    _deliver(*target, outs)


def _deliver(loop, queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the event loop closed: the server is shutting down
        pass
