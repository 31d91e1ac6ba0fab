"""`python -m tfjax.generate --workdir DIR --prompt "..." [--max_new_tokens N --temperature T
--top_k K --top_p P --seed S --step STEP]`

Loads the latest (or `--step`) checkpoint of a `python -m tfjax.train` run and streams
the continuation of the prompt to stdout as it is produced (KV-cached decoding,
`tfjax.inference`). What it reads from the run directory, as the trainer writes it:

  DIR/config.json         the run's whole config (model, train, data, ...)
  DIR/checkpoints/<step>/ orbax checkpoints: item "state" = {step, params, opt, rest}

The model is rebuilt from `config.json`, the tokenizer from `data.tokenizer`; the
prompt is `[bos] + encode(prompt)` as the training documents begin; generation stops
at the tokenizer's EOS (unless `--noeos`). Temperature 0 (the default) is greedy.
Examples:
  python -m tfjax.generate --workdir workdirs/default --prompt "import " --max_new_tokens 200
  python -m tfjax.generate --workdir /tmp/w --prompt "def f(" --temperature 0.8 --top_p 0.95
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TextIO

__all__ = ["load_run", "main", "run"]


def load_run(workdir: str, step: int | None = None):
    """(model, run config, tokenizer, step) from a training run directory."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax.config import run_config
    from tfjax.data.tokenizers import load_tokenizer
    from tfjax.models import build
    from tfjax.train.checkpoint import Checkpointer
    from tfjax.train.optim import make_optimizer

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"--workdir: {path} not found; point --workdir at the directory a "
                         f"`python -m tfjax.train --workdir ...` run wrote")
    with open(path) as f:
        cfg = run_config(json.load(f))
    ckpt = Checkpointer(workdir, dataclasses.replace(cfg.checkpoint, async_save=False))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"--workdir: no finished checkpoint under {ckpt.directory}")

        # The abstract train state exactly as the trainer lays it out, on one device.
        def make_model():
            with nnx.use_eager_sharding(False):
                return build(cfg.model, rngs=nnx.Rngs(cfg.seed))

        abstract = nnx.eval_shape(make_model)
        graphdef, aparams, arest = nnx.split(abstract, nnx.Param, ...)
        aopt = jax.eval_shape(make_optimizer(cfg.train).init, aparams)
        astate = dict(step=jax.ShapeDtypeStruct((), jnp.int32), params=aparams, opt=aopt,
                      rest=arest)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        astate = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                              astate)
        state, _, step = ckpt.restore(astate, step)
    finally:
        ckpt.close()
    model = nnx.merge(graphdef, state["params"], state["rest"])
    model.eval()
    return model, cfg, load_tokenizer(cfg.data.tokenizer), step


def run(workdir: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.0,
        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
        step: int | None = None, stop_at_eos: bool = True, out: TextIO | None = None) -> str:
    """Stream the continuation of `prompt` to `out` (stdout); return it."""
    import numpy as np

    from tfjax.inference import stream

    out = sys.stdout if out is None else out
    model, cfg, tok, step = load_run(workdir, step)
    ids = np.concatenate([[tok.bos_id], tok.encode(prompt)]).astype(np.int32)[None]
    eos = tok.eos_id if stop_at_eos else None
    generated: list[int] = []
    shown = ""
    print(f"[tfjax.generate: step {step} of {workdir}, {cfg.model.arch}, "
          f"{ids.shape[1]} prompt tokens]", file=sys.stderr, flush=True)
    out.write(prompt)
    for t in stream(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_k=top_k, top_p=top_p, eos_id=eos, seed=seed):
        t = int(t[0])
        if t == eos:
            break
        generated.append(t)
        text = tok.decode(generated)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its bytes
            continue
        out.write(text[len(shown):])
        out.flush()
        shown = text
    text = tok.decode(generated)
    out.write(text[len(shown):] + "\n")
    out.flush()
    return text


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tfjax.generate",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--noeos", action="store_true", help="do not stop at the EOS token")
    a = p.parse_args(argv)
    try:
        run(a.workdir, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
            top_k=a.top_k, top_p=a.top_p, seed=a.seed, step=a.step, stop_at_eos=not a.noeos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
