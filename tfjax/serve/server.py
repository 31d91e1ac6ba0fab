"""Running the app with uvicorn: `run_server` (blocking: the command line) and
`running` (a server on a thread, for tests, benchmarks and notebooks: a context that
yields its base URL and stops it on exit). Both bind 127.0.0.1 unless told otherwise.
See docs/serving.md.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

__all__ = ["running", "run_server"]


def run_server(app, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
            timeout: float = 120.0):
    """Serve `app` on a thread (port 0: a free one); yields "http://host:port"."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]),
                              name="tfjax-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
