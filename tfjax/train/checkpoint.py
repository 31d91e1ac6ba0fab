"""orbax checkpoints of the whole run: train state (params, optimizer, step, model RNG
state) and the data iterator's position, under WORKDIR/checkpoints/<step>/.

`Checkpointer(workdir, cfg.checkpoint)`: `save` is asynchronous and atomic (a save killed
midway leaves the previous steps as they were), the last `keep` steps are kept; `restore`
checks the saved tree against the current one before reading an array, places the state
with the current mesh's shardings, and takes the newest step that restores (with
`checkpoint.fallback`, a damaged newer step is moved to WORKDIR/damaged_checkpoints/).
`restore_run` and `load_run` read a finished run back (for `python -m tfjax.generate`,
`tfjax.eval` and `tfjax.export`). See docs/training.md ("Checkpoints and resume").
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from tfjax import storage
from tfjax.config import CheckpointConfig, run_config, upgrade_saved
from tfjax.data.tokenizer import load_tokenizer
from tfjax.models import build, unrolled
from tfjax.train.lora import model_params, train_state_shape

__all__ = ["Checkpointer", "abstract_with_shardings", "load_run", "read_json_object",
           "restore_run"]


class _Damaged(Exception):
    """A step that cannot be read; the message is the reason in a few words."""


class _Mismatch(ValueError):
    """The saved tree does not fit the current one (the config changed: not damage)."""


class Checkpointer:
    """One run's checkpoints: `save` (asynchronous unless `wait`), `restore` (see
    docs/training.md for what is checked and what a damaged step does)."""

    def __init__(self, workdir: str, cfg: CheckpointConfig):
        # a bucket URL as it is (orbax writes gs:// through tensorstore), a local path absolute
        self.workdir = workdir if storage.is_remote(workdir) else os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        self.damaged_directory = os.path.join(self.workdir, "damaged_checkpoints")
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
            cleanup_tmp_directories=True)
        # Handlers registered up front, so a fresh manager can read a step's metadata
        # (the shape check) before anything was saved or restored through it.
        registry = ocp.handlers.create_default_handler_registry(
            state=ocp.StandardCheckpointHandler(), data=ocp.JsonCheckpointHandler())
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             handler_registry=registry)

    def latest_step(self) -> int | None:
        """The newest *finished* step (a save still in flight, or killed, is not one)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step, oldest first."""
        return sorted(self.manager.all_steps())

    def step_directory(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: Any, data_state: dict, *, wait: bool = False) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None, *,
                fallback: bool | None = None, set_aside: bool = False,
                warn: Callable[[str], None] | None = None) -> tuple[Any, dict, int] | None:
        """(state, data_state, step) restored onto the shardings in `abstract_state` (a
        tree of ShapeDtypeStructs with `.sharding`); None when there is no checkpoint.

        `step`: exactly that step (not saved, or damaged: ValueError listing the saved
        steps). None: the newest step that restores. A damaged newer step is skipped
        when `fallback` (default `cfg.fallback`), reported through `warn` (one line per
        step, after a step restored) and, with `set_aside`, moved whole to
        WORKDIR/damaged_checkpoints/<step>/; without fallback it is a ValueError. A
        tree that does not fit `abstract_state` is a ValueError at once (not damage),
        as is no step restoring; neither changes anything on disk."""
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise ValueError(f"no checkpoint of step {step} under {self.directory}; "
                                 f"saved steps: {_list(steps)}")
            try:
                return self._restore_step(abstract_state, step)
            except _Damaged as e:
                others = [s for s in steps if s != step]
                raise ValueError(f"checkpoint step {step} ({self.step_directory(step)}) cannot "
                                 f"be read ({e}); other saved steps: {_list(others)}") from None
        fallback = self.cfg.fallback if fallback is None else fallback
        damaged: list[tuple[int, str]] = []
        for s in reversed(steps):
            try:
                got = self._restore_step(abstract_state, s)
            except _Damaged as e:
                if not fallback:
                    raise ValueError(
                        f"checkpoint step {s} ({self.step_directory(s)}) cannot be read ({e}); "
                        f"resume from the newest readable older step with "
                        f"--config.checkpoint.fallback=True, or remove {self.step_directory(s)}"
                    ) from None
                damaged.append((s, str(e)))
                continue
            for bad, reason in damaged:
                where = self.step_directory(bad)
                if set_aside:
                    kept = f"kept, not deleted: moved to {self._set_aside(bad)}"
                else:
                    kept = "left in place"
                (warn or print)(f"checkpoint step {bad} ({where}) cannot be read ({reason}); "
                                f"restored step {s} instead; the damaged step was {kept}")
            return got
        if damaged:
            raise ValueError(
                f"no checkpoint under {self.directory} can be read: "
                + "; ".join(f"step {s}: {r}" for s, r in damaged)
                + "; nothing was changed: repair or remove them, or start over with a new "
                  "--workdir")
        return None

    def _restore_step(self, abstract_state: Any, step: int) -> tuple[Any, dict, int]:
        """Check the saved tree against `abstract_state` (ValueError: a different model),
        then read both items; any failure to read is `_Damaged`. With several processes,
        a step counts as restored only if it restored on every process."""
        state = data = reason = None
        try:
            self._check_tree(abstract_state, step)
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))["state"]
            data = dict(self.manager.restore(step, args=ocp.args.Composite(
                data=ocp.args.JsonRestore()))["data"])
        except _Mismatch as e:  # a plain ValueError for the caller: a config error
            raise ValueError(str(e)) from None
        except _Damaged as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - any failure to read is damage (shapes are checked)
            reason = f"{'arrays' if state is None else 'data position'}: {_reason(e)}"
        if reason is not None:
            # orbax's abandoned reads of the other arrays (coroutines in reference cycles
            # with the traceback) are finalised now, not in a later collection inside
            # unrelated code: their "Exception ignored" report formats a traceback, and
            # CPython 3.11's ast.parse, if that is what the collection interrupted, fails
            # with "AST constructor recursion depth mismatch".
            gc.collect()
        if not _on_every_process(reason is None):
            raise _Damaged(reason or "it cannot be read on another process")
        return state, data, step

    def with_saved_reference(self, abstract_state: dict, step: int | None = None) -> dict:
        """`abstract_state` plus the frozen model a dpo / ipo / grpo / distill run saved
        (`state["reference"]`, `tfjax.train.reference`) as the checkpoint's metadata
        describes it, so a reader that needs only the policy (export, evaluation,
        init_from) restores the run without knowing its teacher."""
        steps = self.all_steps()
        if "reference" in abstract_state or not steps:
            return abstract_state
        try:
            saved = self.manager.item_metadata(steps[-1] if step is None else step)["state"]
        except Exception:  # noqa: BLE001 - unreadable metadata: the restore says so
            return abstract_state
        if not hasattr(saved, "keys") or "reference" not in saved.keys():
            return abstract_state
        ref = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                           saved["reference"])
        return dict(abstract_state, reference=ref)

    def _check_tree(self, abstract_state: Any, step: int) -> None:
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001
            raise _Damaged(f"metadata: {_reason(e)}") from None
        if saved is None:
            raise _Damaged("metadata: state/_METADATA is missing")
        have = {_name(p): getattr(x, "shape", None)
                for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
        want = {_name(p): _stored_shape(x)
                for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
        diffs = []
        names = [*want, *(n for n in have if n not in want)]  # tree order, parameters first
        for name in sorted(names, key=lambda n: not n.startswith("params.")):
            if name not in have:
                diffs.append(f"{name} {tuple(want[name])} is in the current model but not in "
                             f"the checkpoint")
            elif name not in want:
                diffs.append(f"{name} {tuple(have[name])} is in the checkpoint but not in the "
                             f"current model")
            elif have[name] is not None and tuple(have[name]) != tuple(want[name]):
                diffs.append(f"{name} has shape {tuple(have[name])} in the checkpoint but "
                             f"{tuple(want[name])} in the current model")
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise _Mismatch(
                f"checkpoint step {step} ({self.step_directory(step)}) does not fit the current "
                f"model: {diffs[0]}{more}; the model config changed since it was saved: rerun "
                f"with the saved config, or train the new model with a new --workdir")

    def _set_aside(self, step: int) -> str:
        """Move damaged step `step` whole to WORKDIR/damaged_checkpoints/ (process 0, on
        the shared file system orbax needs anyway); the path it now has."""
        dest = os.path.join(self.damaged_directory, str(step))
        i = 0
        while storage.path(dest).exists():  # damaged once before: keep both
            i += 1
            dest = os.path.join(self.damaged_directory, f"{step}.{i}")
        if jax.process_index() == 0:
            storage.path(self.damaged_directory).mkdir(parents=True, exist_ok=True)
            storage.path(self.step_directory(step)).rename(dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"tfjax:set_aside:{step}")
        self.manager.reload()
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, shardings)


def restore_run(workdir: str, step: int | None = None):
    """(run config, graphdef, train state, `tfjax.train.lora.Lora` or None, step): the
    checkpoint `load_run` reads, as the trainer lays it out, on one device."""
    storage.check_reachable(workdir, "--workdir")
    path = os.path.join(workdir, "config.json")
    if not storage.path(path).exists():
        raise ValueError(f"--workdir: {path} not found; point --workdir at the directory a "
                         f"`python -m tfjax.train --workdir ...` run wrote")
    # runs saved before a field moved
    cfg = run_config(upgrade_saved(read_json_object(path, "--workdir", "a run config")))
    ckpt = Checkpointer(workdir, dataclasses.replace(cfg.checkpoint, async_save=False))
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(f"--workdir: no finished checkpoint under {ckpt.directory} (a run "
                             f"saves every checkpoint.every_steps steps and at its end)")
        if step is not None and step not in steps:
            raise ValueError(f"--step {step}: no checkpoint of that step under {ckpt.directory}; "
                             f"saved steps: {', '.join(map(str, steps))} (omit --step for the "
                             f"latest)")

        # The abstract train state exactly as the trainer lays it out, on one device.
        def make_model():
            with nnx.use_eager_sharding(False):
                return build(cfg.model, rngs=nnx.Rngs(cfg.seed))

        abstract = nnx.eval_shape(make_model)
        graphdef, aparams, arest = nnx.split(abstract, nnx.Param, ...)
        astate, lora, _ = train_state_shape(cfg, aparams, arest)
        astate = ckpt.with_saved_reference(astate, step)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        astate = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                              astate)
        # step None: the newest that restores; a damaged newer one is left in place, with
        # a warning (the trainer moves it aside when it resumes).
        state, _, step = ckpt.restore(astate, step, warn=lambda s: print(
            f"warning: {s}", file=sys.stderr, flush=True))
    finally:
        ckpt.close()
    return cfg, graphdef, state, lora, step


def load_run(workdir: str, step: int | None = None):
    """(model, run config, tokenizer, step) from a training run directory: checkpoint
    `step`, or the newest that restores (a LoRA run's base merged with its adapters),
    its layers unrolled for decoding (`tfjax.models.unrolled`).
    No checkpoint, a step not saved, a damaged `step` or a model that does not fit the
    saved one is a one-line ValueError."""
    cfg, graphdef, state, lora, step = restore_run(workdir, step)
    model = nnx.merge(graphdef, model_params(lora, state), state["rest"])
    model.eval()
    # decoding: unrolled layers update their caches in place (a scanned stack copies them)
    return unrolled(model), cfg, load_tokenizer(cfg.data.tokenizer), step


def read_json_object(path: str, where: str, what: str) -> dict:
    """The JSON object in file `path` (a checkpoint's config.json, generation_config.json,
    ...); not JSON, or JSON of another type, is a one-line ValueError that starts with
    `where` (the flag or field that named the file) and names `what` it should hold."""
    try:
        out = json.loads(storage.path(path).read_bytes())  # local or on a bucket
    except ValueError as e:
        raise ValueError(f"{where}: {path} is not valid JSON ({e}); fix or re-save it") from None
    if not isinstance(out, dict):
        raise ValueError(f"{where}: {path} holds {type(out).__name__}, not the JSON object of "
                         f"{what}")
    return out


def _on_every_process(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _stored_shape(x: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    """The shape orbax stores: a typed PRNG key array is saved as its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, x).shape
    return x.shape


def _name(path) -> str:
    """A tree path as orbax names arrays (`params.blocks.0.q`), without the `.value` of
    an NNX variable; the same for the saved tree (dict keys) and the live one."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def _reason(e: BaseException) -> str:
    """The root cause of a failed read in a few words (tensorstore's first line, without
    its spec dump and file URL)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().split("\n")[0]
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
    text = re.sub(r"\s*(\[tensorstore_spec|See full TensorStore details).*", "", text)
    text = text if len(text) <= 140 else text[:137] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"
