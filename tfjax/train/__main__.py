"""`python -m tfjax.train --config configs/<preset>.py[:arg] --workdir DIR [--config.<field>=<value> ...]`

Examples:
  python -m tfjax.train --config configs/default.py --workdir workdirs/default
  python -m tfjax.train --config configs/default.py --workdir /tmp/w \\
      --config.train.steps=200 --config.mesh.data=4 --config.mesh.fsdp=2 --cpu_devices=8
Rerunning the same command resumes from the latest checkpoint in WORKDIR. Multi-process
runs take --coordinator_address, --num_processes and --process_id (or --distributed);
--compile_only AOT-compiles the train step. A config error is one line (exit status 2)
before anything compiles. See docs/training.md ("The command line: python -m tfjax.train").
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from tfjax.config import moved_field, run_config, unknown_field
from tfjax.eval import tasks
from tfjax.models import check_names
from tfjax.parallel.mesh import use_cpu_cores
from tfjax.train.aot import compile_only
from tfjax.train.init_from import resolve_init_from
from tfjax.train.rl import GRPOTrainer
from tfjax.train.trainer import Trainer

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
config_flags.DEFINE_config_file("config", "configs/default.py", "preset: configs/<name>.py[:arg]",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and TensorBoard events go here")
flags.DEFINE_integer("cpu_devices", -1, "CPU devices (XLA host platform): N simulates N; -1 "
                     "(default): one per usable core for a data-parallel mesh whose batch they "
                     "divide (tfjax.parallel.mesh.use_cpu_cores); 0: the platform's own one")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process)")
flags.DEFINE_integer("num_processes", None, "number of processes (multi-process)")
flags.DEFINE_integer("process_id", None, "this process's index (multi-process)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() with auto-detection")
flags.DEFINE_bool("compile_only", False, "AOT-compile the train step and print memory; no training")
flags.DEFINE_string("topology", None, "with --compile_only: a TPU slice such as v5p:4x4x4, "
                    "or a host of GPUs such as h200:8 (jax's CUDA plugin, no GPU)")
flags.DEFINE_integer("num_slices", 1, "with --compile_only --topology: compile for this many "
                     "TPU slices of the topology (mesh.dcn_data / mesh.dcn_fsdp span them)")


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:  # orbax logs every save at INFO; keep the bar readable
        logging.set_verbosity(logging.WARNING)
    if FLAGS.workdir is None and not FLAGS.compile_only:
        raise app.UsageError("--workdir is required (checkpoints and metrics are written there)")
    if FLAGS.cpu_devices < -1:
        print(f"error: --cpu_devices must be -1 (one per core), 0 (the platform's own) or a "
              f"count, got {FLAGS.cpu_devices}", file=sys.stderr)
        return 2
    if FLAGS.compile_only:  # libtpu's lockfile guards real chips; topologies need none
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    multi_process = FLAGS.coordinator_address or FLAGS.num_processes or FLAGS.distributed
    if FLAGS.cpu_devices > 0:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={FLAGS.cpu_devices}")
    elif FLAGS.cpu_devices == -1 and not multi_process and not FLAGS.compile_only:
        try:
            run = run_config(FLAGS.config)
        except ValueError:
            run = None  # the config's own error is reported below, before anything compiles
        if run is not None:
            use_cpu_cores(run.mesh, run.train.batch_size // run.train.microbatches)
    if FLAGS.coordinator_address or FLAGS.num_processes:
        # CPU processes need gloo for cross-process collectives (ignored by TPU / GPU).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                                   FLAGS.process_id)
    elif FLAGS.distributed:
        jax.distributed.initialize()

    try:
        cfg = resolve_init_from(run_config(FLAGS.config))  # fine-tuning: the checkpoint's model
        check_names(cfg.model)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if FLAGS.compile_only:
        try:  # a mesh that does not fit the slices is one line, before compiling
            return compile_only(cfg, FLAGS.topology, num_slices=FLAGS.num_slices)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:  # a bad run (data, mesh, a checkpoint that cannot resume) is refused before compiling
        if cfg.train.objective == "grpo":  # RL: rollouts from the engine (tfjax.train.rl)
            trainer = GRPOTrainer(cfg, FLAGS.workdir)
        else:
            trainer = Trainer(cfg, FLAGS.workdir, eval_hooks=eval_hooks(cfg))
        summary = trainer.train()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 143 if summary.get("preempted") else 0


def eval_hooks(cfg) -> list:
    """`train.eval_tasks`: lm-eval-harness tasks scored at every evaluation
    (`tfjax.eval.tasks.training_evaluator`; lm_eval is the optional `eval` extra, so
    it is imported only when tasks are named). Unknown tasks fail here."""
    t = cfg.train
    if not t.eval_tasks:
        return []
    try:
        tasks.lm_eval_model()
    except ImportError as e:
        raise ValueError(f"train.eval_tasks needs lm_eval: pip install 'tfjax[eval]' ({e})") from e
    return [tasks.training_evaluator(t.eval_tasks, include_path=t.eval_tasks_path,
                                     limit=t.eval_tasks_limit, batch_size=8)]


def _config_error(message: str):
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def _config_path(argv: list[str]) -> tuple[str, bool]:
    """(the preset file `--config` names, without its `:arg`; whether it was given)."""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1].split(":", 1)[0], True
        if arg.startswith("--config="):
            return arg[len("--config="):].split(":", 1)[0], True
    return FLAGS["config"].default_as_str.strip("'\""), False


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, after checks of ours that turn what would be a traceback
    into one line (exit status 2): a `--config` file that does not exist (also the
    default, when `--config` is omitted outside the repository), an override of a
    field that moved (`--config.model.moe_d_ff=...`, naming the new path) or does not
    exist (`--config.model.num_layerz`, with the closest field), and whatever the
    preset or an override value raises while loading."""
    path, given = _config_path(argv)
    if not os.path.isfile(path):
        in_repo = os.path.join(REPO, path)
        hint = (f"; did you mean {in_repo}?" if os.path.isfile(in_repo) else
                f"; presets are in {os.path.join(REPO, 'configs')}" if os.path.isdir(
                    os.path.join(REPO, "configs")) else "")
        what = "--config" if given else "no --config given, and the default"
        _config_error(f"{what} {path}: no such file (relative to {os.getcwd()}){hint}")
    for arg in argv[1:]:
        if arg.startswith("--config."):
            field = arg[len("--config."):].split("=", 1)[0]
            now = moved_field(field)
            if now:
                _config_error(f"{field} moved to {now} (--config.{now}=...)")
            unknown = unknown_field(field)
            if unknown:
                _config_error(f"--config.{field}: {unknown}")
    try:
        return FLAGS(argv)
    except flags.Error as e:  # absl's "flag --config...: <message>", maybe with a traceback
        lines = [line for line in str(e).splitlines() if line.strip()]
        _config_error(lines[0] if len(lines) == 1 else f"{lines[0].split(': ')[0]}: {lines[-1]}")
    except Exception as e:  # noqa: BLE001 -- the preset's own code raised while loading
        _config_error(f"--config {path}: {type(e).__name__}: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
