"""`python -m tfjax.serve (--hf DIR | --workdir W [--step S]) [--host 127.0.0.1 --port 8000
--max_seqs N --max_len L --page_size P --chunk C --prefill_rows R --num_pages K --kv_memory BYTES
--max_queue Q --served_model_name NAME --quantize int8|int4 --quantize_group G
--kv_quant int8|fp8]`

Serves the model with OpenAI's API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`) on continuous batching (`tfjax.inference.engine`), bound to
127.0.0.1 unless `--host` says otherwise. Bad flags are one line (exit status 2)
before the model loads. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import sys

from tfjax.generate import add_checkpoint_flags, add_quant_flags, quant_kwargs
from tfjax.inference.engine import EngineConfig
from tfjax.serve.app import create_app
from tfjax.serve.served import load_served
from tfjax.serve.server import run_server

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfjax.serve",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p)
    p.add_argument("--step", type=int, default=None, help="with --workdir: checkpoint step "
                   "(default: latest)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every "
                   "interface; the server has no authentication)")
    p.add_argument("--port", type=int, default=8000)
    d = EngineConfig()
    p.add_argument("--max_seqs", type=int, default=d.max_seqs, help="sequences decoded at once")
    p.add_argument("--max_len", type=int, default=d.max_len,
                   help="tokens of a sequence, prompt and answer (0: the model's context)")
    p.add_argument("--page_size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--chunk", type=int, default=d.chunk, help="prompt tokens a row prefills "
                   "per step")
    p.add_argument("--prefill_rows", type=int, default=d.prefill_rows,
                   help="the most rows that prefill a chunk in one step")
    p.add_argument("--num_pages", type=int, default=d.num_pages, help="KV pages (0: from "
                   "--kv_memory, or enough for every sequence's max_len)")
    p.add_argument("--kv_memory", type=float, default=d.kv_memory,
                   help="bytes of KV pages, e.g. 4e9 (0: see --num_pages)")
    p.add_argument("--max_queue", type=int, default=128, help="requests that may wait for "
                   "a slot; beyond them the server answers 429")
    p.add_argument("--served_model_name", default=None, help="the model id clients send "
                   "(default: the --hf / --workdir path)")
    p.add_argument("--log_level", default="info", help="uvicorn's log level")
    add_quant_flags(p)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.hf is not None and a.step is not None:
            raise ValueError("--step is for --workdir runs; an HF checkpoint has one state")
        if not 0 <= a.port < 65536:
            raise ValueError(f"--port: {a.port} is not a TCP port (0-65535)")
        if a.max_queue < 1:
            raise ValueError(f"--max_queue: must be >= 1, got {a.max_queue}")
        config = EngineConfig(max_seqs=a.max_seqs, max_len=a.max_len, page_size=a.page_size,
                              chunk=a.chunk, prefill_rows=a.prefill_rows, num_pages=a.num_pages,
                              kv_memory=int(a.kv_memory))
        config.check()
        served = load_served(hf=a.hf, workdir=a.workdir, step=a.step,
                             name=a.served_model_name, config=config, max_queue=a.max_queue,
                             quant=quant_kwargs(a))
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    served.loop.engine.warm_up()  # every step shape compiled before the first request
    print(f"[tfjax.serve: {served.name} on http://{a.host}:{a.port} ({served.max_len} tokens "
          f"of context, {config.max_seqs} sequences at once)]", file=sys.stderr, flush=True)
    run_server(create_app(served), a.host, a.port, a.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
