"""The inference engine: paged KV caches, continuous batching, per-request sampling.

`Engine` (`engine`), `Request` and `Output` (`requests`), `PagePool` (`pages`). The
server (`tfjax.serve`), the evaluation harness and RL rollouts sit on it. See
docs/inference.md ("The engine").
"""

from tfjax.inference.engine.engine import Engine, EngineConfig
from tfjax.inference.engine.pages import PagePool, chain_hashes
from tfjax.inference.engine.requests import FINISH_REASONS, Output, Request

__all__ = ["FINISH_REASONS", "Engine", "EngineConfig", "Output", "PagePool", "Request",
           "chain_hashes"]
