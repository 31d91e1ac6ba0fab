"""`python -m tfjax.train --config configs/<preset>.py[:arg] --workdir DIR [--config.<field>=<value> ...]`

Examples:
  python -m tfjax.train --config configs/default.py --workdir workdirs/default
  python -m tfjax.train --config configs/default.py --workdir /tmp/w \\
      --config.train.steps=200 --config.mesh.data=4 --config.mesh.fsdp=2 --cpu_devices=8
Multi-process (one command per process; gloo collectives on CPU):
  python -m tfjax.train ... --coordinator_address=localhost:1234 --num_processes=2 --process_id=0
On a TPU pod or a SLURM cluster, `--distributed` lets jax find its peers.
Rerunning the same command resumes from the latest checkpoint in WORKDIR.

A config error (a bad value, an unknown name, a field that moved, such as
`--config.model.num_experts`, now `--config.model.moe.num_experts`) is printed as
one line before anything compiles, with exit status 2. `--cpu_devices` and the
multi-process flags take effect because jax reads them when its backend starts,
at the first device query in `main`, not when it is imported.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from tfjax.config import moved_field, run_config
from tfjax.models import check_names
from tfjax.train.aot import compile_only
from tfjax.train.trainer import Trainer

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/default.py", "preset: configs/<name>.py[:arg]",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and TensorBoard events go here")
flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (XLA host platform)")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process)")
flags.DEFINE_integer("num_processes", None, "number of processes (multi-process)")
flags.DEFINE_integer("process_id", None, "this process's index (multi-process)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() with auto-detection")
flags.DEFINE_bool("compile_only", False, "AOT-compile the train step and print memory; no training")
flags.DEFINE_string("topology", None, "with --compile_only: a TPU slice such as v5p:4x4x4, "
                    "or a host of GPUs such as h200:8 (jax's CUDA plugin, no GPU)")


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # orbax logs every save at INFO; keep the bar readable
        logging.set_verbosity(logging.WARNING)
    if FLAGS.workdir is None and not FLAGS.compile_only:
        raise app.UsageError("--workdir is required (checkpoints and metrics are written there)")
    if FLAGS.compile_only:  # libtpu's lockfile guards real chips; topologies need none
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if FLAGS.cpu_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={FLAGS.cpu_devices}")
    if FLAGS.coordinator_address or FLAGS.num_processes:
        # CPU processes need gloo for cross-process collectives (ignored by TPU / GPU).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                                   FLAGS.process_id)
    elif FLAGS.distributed:
        jax.distributed.initialize()

    try:
        cfg = run_config(FLAGS.config)
        check_names(cfg.model)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if FLAGS.compile_only:
        return compile_only(cfg, FLAGS.topology)
    try:
        trainer = Trainer(cfg, FLAGS.workdir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = trainer.train()
    return 143 if summary["preempted"] else 0


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, after one check of ours: an override of a field that
    moved (`--config.model.moe_d_ff=...`) is a one-line error naming the new path
    (the locked preset would otherwise fail with a traceback)."""
    for arg in argv[1:]:
        if arg.startswith("--config."):
            path = arg[len("--config."):].split("=", 1)[0]
            now = moved_field(path)
            if now:
                print(f"config error: {path} moved to {now} (--config.{now}=...)",
                      file=sys.stderr)
                sys.exit(2)
    return FLAGS(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
