"""An OpenAI-compatible server on the inference engine (FastAPI + uvicorn, the `serve`
extra): `python -m tfjax.serve --hf DIR | --workdir W`.

- `served`: `Served` (a model under a name, its tokenizer, chat template and engine
  loop), `load_served` (from `--hf` / `--workdir`, as `tfjax.generate` loads them).
- `loop`: `EngineLoop` (the thread that steps the engine; the bounded queue).
- `app`: `create_app` (the endpoints and their errors); `answers`, `protocol`,
  `detokenize`: the answers, the request bodies, incremental detokenization.
- `server`: `run_server`, `running` (a server on a thread). See docs/serving.md.
"""

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:
    raise ImportError(f"tfjax.serve needs the serve extra ({e.name} is missing): "
                      f"pip install 'tfjax[serve]'") from None

from tfjax.serve.app import create_app  # noqa: E402
from tfjax.serve.loop import EngineLoop, QueueFull  # noqa: E402
from tfjax.serve.served import Served, load_served, serve_source  # noqa: E402
from tfjax.serve.server import run_server, running  # noqa: E402

__all__ = ["EngineLoop", "QueueFull", "Served", "create_app", "load_served", "run_server",
           "running", "serve_source"]
