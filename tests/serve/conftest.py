"""Shared by the server tests: the tiny checkpoint of `serve_fixtures` and one server on
127.0.0.1 over it (a free port, a thread; stopped at the end), which the test modules
share. They need the `hf` extra (torch, transformers), the `serve` extra (fastapi,
uvicorn) and the official `openai` client (the `test` extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")

from serve_fixtures import CONFIG, NAME, save  # noqa: E402

from tfjax.serve import create_app, load_served, running  # noqa: E402


@pytest.fixture(autouse=True, scope="package")
def _torch_on_one_thread(one_torch_thread):
    pass


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """(directory, the transformers model, its tokenizer)."""
    path = tmp_path_factory.mktemp("serve_llama")
    model, tok = save(path)
    return path, model, tok


class Server:
    """A running server: its `url`, `served` (the engine loop and engine inside) and an
    openai client."""

    def __init__(self, url, served):
        self.url, self.served = url, served
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=120)

    @property
    def engine(self):
        return self.served.loop.engine


@pytest.fixture(scope="session")
def server(checkpoint):
    served = load_served(hf=str(checkpoint[0]), name=NAME, config=CONFIG, max_queue=64)
    with running(create_app(served)) as url:
        yield Server(url, served)
