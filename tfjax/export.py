"""`python -m tfjax.export --workdir W --out DIR [--step STEP] [--dtype DTYPE] [--adapters_only]`

Writes a training run (pretraining or a fine-tune) as a Hugging Face checkpoint: the
newest checkpoint of W that restores (or `--step`) through `tfjax.interop.hf.export`
(`config.json`, `model.safetensors`; any family `tfjax.interop.hf.load` reads), with the
run's tokenizer, so that transformers and `python -m tfjax.generate --hf DIR` read it.
A LoRA run is exported merged, or with `--adapters_only` as PEFT adapters. `export_run`
is the same from Python; an error is one line on stderr (exit status 2) before anything
is written. See docs/training.md ("Export: `python -m tfjax.export`").
"""

from __future__ import annotations

import argparse
import sys

from tfjax.interop import hf
from tfjax.train.checkpoint import load_run, restore_run
from tfjax.train.lora import write_peft

__all__ = ["export_run", "main"]


def export_run(workdir: str, out: str, *, step: int | None = None,
               dtype: str | None = None, adapters_only: bool = False) -> int:
    """Export checkpoint `step` (None: the newest that restores) of the run in
    `workdir` to the HF directory `out`, with its tokenizer (a LoRA run merged), or
    with `adapters_only` its LoRA adapters in PEFT's format; returns the step."""
    if adapters_only:
        cfg, _, state, lora, step = restore_run(workdir, step)
        if lora is None:
            raise ValueError(f"--adapters_only: the run in {workdir} has no LoRA adapters "
                             f"(lora.rank=0); export it whole, without --adapters_only")
        write_peft(lora, cfg, state, out, dtype)
        return step
    model, _, tokenizer, step = load_run(workdir, step)
    hf.export(model, out, dtype=dtype, tokenizer=tokenizer)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfjax.export",
                                description="Write a tfjax training run as a Hugging Face "
                                            "checkpoint (any family tfjax.interop.hf "
                                            "reads) with its tokenizer.")
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--out", required=True, help="the HF checkpoint directory to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="dtype on disk (default: the run's model.param_dtype)")
    p.add_argument("--adapters_only", action="store_true",
                   help="a LoRA run: write its adapters alone in PEFT's format (default: "
                        "the model with the adapters merged)")
    a = p.parse_args(argv)
    try:
        step = export_run(a.workdir, a.out, step=a.step, dtype=a.dtype,
                          adapters_only=a.adapters_only)
    except (ValueError, NotImplementedError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tfjax.export: step {step} of {a.workdir} -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
