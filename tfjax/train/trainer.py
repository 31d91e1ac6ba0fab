"""The one training loop of tfjax (`python -m tfjax.train`).

    cfg = tfjax.config.run_config(get_config())
    Trainer(cfg, workdir).train()

`Trainer` checks the run against the devices and the data (`check_run`), builds its
jitted, sharded programs on the mesh (`tfjax.train.program.build_program`), feeds the
objective's packed batches, saves and resumes orbax checkpoints (SIGTERM saves, then
stops every process at the same step), evaluates and writes the metrics; `train()`
returns the run's summary. See docs/training.md ("What a run does, in order").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from tfjax import storage
from tfjax.config import RunConfig, parse_profile_steps
from tfjax.data.mixture import check_caches
from tfjax.data.pipeline import PackedBatches
from tfjax.data.tokenizer import load_tokenizer
from tfjax.inference import generate
from tfjax.models import build, check_names
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules
from tfjax.parallel.sharding import use_rules
from tfjax.train.checkpoint import Checkpointer, abstract_with_shardings
from tfjax.train.compile_cache import persistent_compilation_cache
from tfjax.train.init_from import (check_tokenizer, initial_state, load_teacher,
                                   resolve_init_from, teacher_config)
from tfjax.train.lora import model_params
from tfjax.train.losses import LN2
from tfjax.train.metrics import (MetricWriter, ProgressBar, WallClock, compression_report,
                                 flops_per_token, peak_flops)
from tfjax.train.objectives import OBJECTIVES, check_objective, eval_line, eval_metrics
from tfjax.train.optim import lr_schedule
from tfjax.train.program import Program, _axes_size, build_program, zigzag_devices, zigzag_rows

__all__ = ["Program", "Trainer", "build_program", "check_run", "zigzag_devices", "zigzag_rows"]


def check_run(cfg: RunConfig, mesh, tokenizer) -> None:
    """Device- and data-dependent checks; each error names the field and the fix."""
    rules = logical_rules(cfg.mesh.rules)
    t, m = cfg.train, cfg.model
    nb, baxes = _axes_size(mesh, rules, "batch")
    if t.batch_size % (nb * t.microbatches):
        need = nb * t.microbatches
        raise ValueError(
            f"train.batch_size: {t.batch_size} is not divisible by the {nb} batch shards "
            f"(mesh {'*'.join(baxes) or '-'} = {nb}) x train.microbatches={t.microbatches}; "
            f"use a multiple of {need}, e.g. {max(need, t.batch_size // need * need)}")
    ns, saxes = _axes_size(mesh, rules, "length")
    if t.seq_len % ns:
        raise ValueError(
            f"train.seq_len: {t.seq_len} is not divisible by the sequence axis "
            f"(mesh {'*'.join(saxes)} = {ns}); use a multiple of {ns}")
    if tokenizer.vocab_size > m.vocab_size:
        raise ValueError(
            f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer!r}); set "
            f"--config.model.vocab_size={tokenizer.vocab_size} or more")
    if m.position in ("learned", "sinusoidal") and t.seq_len > m.max_len:
        raise ValueError(f"train.seq_len: {t.seq_len} > model.max_len={m.max_len} (the "
                         f"{m.position} position table); lower seq_len or raise max_len")
    check_objective(cfg, tokenizer, ns)  # train.objective against model.arch, specials
    if t.batch_size % jax.process_count():
        raise ValueError(f"train.batch_size: {t.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")


class Trainer:
    """Builds everything from a validated `RunConfig`; `train()` runs the loop. The
    jitted init / train step / eval step and their shardings are `self.program`
    (`tfjax.train.program.Program`)."""

    def __init__(self, cfg: RunConfig, workdir: str, *,
                 build_model: Callable[..., nnx.Module] | None = None,
                 devices=None, log: Callable[[str], None] | None = None,
                 eval_hooks: Sequence[Callable[[Trainer, Any], dict[str, float]]] = ()):
        # fine-tuning (`init_from`): the model and tokenizer come from the checkpoint
        storage.check_reachable(workdir, "--workdir")  # a bucket: one line, before building
        self.cfg = cfg = resolve_init_from(cfg.validate())
        self.workdir = workdir
        self.eval_hooks = tuple(eval_hooks)  # hook(trainer, state) -> more eval metrics
        self.log = log or (lambda s: print(s, flush=True) if jax.process_index() == 0 else None)
        check_names(cfg.model)  # registry-owned names, before anything is built
        self.build_model = build_model or build
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        check_tokenizer(cfg, self.tokenizer)
        self.mesh = make_mesh(cfg.mesh, devices)
        self.rules = logical_rules(cfg.mesh.rules)
        check_run(cfg, self.mesh, self.tokenizer)
        t = cfg.train
        self.objective = OBJECTIVES.get(t.objective, field="train.objective")
        self.train_docs = self.objective.source(cfg, "train")  # documents, or jsonl examples
        self.val_docs = self.objective.source(cfg, "validation")
        if cfg.data.source == "cache":  # made with the run's tokenizer, before compiling
            check_caches([*self.train_docs, *self.val_docs], self.tokenizer, cfg.data.tokenizer)
        # LoRA: program.lora; dpo / ipo / distill: program.reference (the frozen model)
        self.program = build_program(cfg, self.mesh, self.build_model, teacher_config(cfg))
        self.local_rows = self._local_rows(t.batch_size)
        self._lr = lr_schedule(t)
        self.checkpointer = Checkpointer(workdir, cfg.checkpoint)
        self.history: dict[int, float] = {}
        self._stop = False  # set by the Python SIGTERM handler (when one is installed)
        self._preemption_sync: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ data
    def _local_rows(self, batch: int) -> list[int]:
        index_map = self.program.batch_sharding.addressable_devices_indices_map((batch, 1))
        rows: set[int] = set()
        for idx in index_map.values():
            rows.update(range(*idx[0].indices(batch)))
        return sorted(rows)

    def train_iterator(self) -> PackedBatches:
        """The objective's endless, checkpointable batches of the train split."""
        return self.objective.batches(self.cfg, self.tokenizer, self.train_docs,
                                      self.local_rows, True)

    def val_iterator(self, local: bool = True) -> PackedBatches:
        """One pass over the validation split, in order."""
        return self.objective.batches(self.cfg, self.tokenizer, self.val_docs,
                                      self.local_rows if local else None, False)

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays sharded over the batch axes (in zig-zag
        order along the sequence when `program.zigzag`, as the compiled steps expect)."""
        t, zz = self.cfg.train, self.program.zigzag
        if zz:
            local = {k: zigzag_rows(v, zz) if v.ndim == 2 else v
                     for k, v in local.items()}
        where = {r: i for i, r in enumerate(self.local_rows)}

        def one(x, sharding):
            def piece(idx):
                rows = range(*idx[0].indices(t.batch_size))
                return x[[where[r] for r in rows]][(slice(None), *idx[1:])]
            return jax.make_array_from_callback((t.batch_size, *x.shape[1:]), sharding, piece)

        return {k: one(local[k], s) for k, s in self.program.batch_shardings.items()}

    # ----------------------------------------------------------------- state
    def init_state(self):
        """A fresh start: the program's init, or the weights `init_from` names
        (`tfjax.train.init_from`: never called when WORKDIR has a checkpoint)."""
        state = (initial_state(self.program, self.cfg, self.mesh, self.log) if self.cfg.init_from
                 else self.program.init())
        if self.cfg.train.teacher:
            state = load_teacher(self.program, self.cfg, self.mesh, state, self.log)
        return state

    def restore_or_init(self):
        """(state, data_state, step): the newest checkpoint in WORKDIR that restores, or a
        fresh start when WORKDIR has none (`Checkpointer.restore`, before anything
        compiles). A damaged newer step is skipped with one warning line and moved to
        WORKDIR/damaged_checkpoints/ (`checkpoint.fallback`), or stops the run; a
        checkpoint of another model shape, or none that restores, is a ValueError. So is
        `checkpoint.resume=False` over a WORKDIR that already has checkpoints: the fresh
        run could not save the step numbers they hold (orbax never replaces a step), and
        a later resume would mix the two runs."""
        c = self.cfg.checkpoint
        if c.enabled and c.resume:
            abstract = abstract_with_shardings(self.program.abstract_state,
                                               self.program.state_shardings)
            got = self.checkpointer.restore(abstract, set_aside=True,
                                            warn=lambda s: self.log(f"  warning: {s}"))
            if got is not None:
                state, data_state, step = got
                return state, data_state, step
        elif c.enabled and (steps := self.checkpointer.all_steps()):
            raise ValueError(
                f"checkpoint.resume=False, but {self.checkpointer.directory} already holds "
                f"steps {', '.join(map(str, steps))} of a run; a fresh run could not save over "
                f"them: use a new --workdir, or remove {self.checkpointer.directory}")
        return self.init_state(), None, 0

    # ------------------------------------------------------------- evaluate
    def evaluate(self, state) -> dict[str, float]:
        """val_loss (nats per scored token or example) and, as the objective says
        (`eval_metrics`), val_bpb / val_accuracy over `train.eval_batches` batches (0:
        all) of the validation split, read in order."""
        sums = dict.fromkeys(("nll", "tokens", "bytes", *self.objective.extra), 0.0)
        for i, local in enumerate(self.val_iterator()):
            if self.cfg.train.eval_batches and i >= self.cfg.train.eval_batches:
                break
            out = self.program.eval(state, self.global_batch(local))
            for k in sums:
                sums[k] += float(out[k])
        metrics = eval_metrics(self.objective, sums)
        for hook in self.eval_hooks:  # e.g. lm-eval tasks (`tfjax.eval.harness`)
            metrics.update(hook(self, state))
        return metrics

    def model(self, state) -> nnx.Module:
        """The model in eval mode computing with `state`'s parameters (on the mesh)."""
        p = self.program
        return nnx.merge(p.eval_graphdef, model_params(p.lora, state), state["rest"])

    def validation_bytes(self) -> bytes:
        """The bytes `evaluate` scores (byte tokenizer), each row's stream in order (so
        gzip / xz see whole documents, as the model does), for the baselines."""
        per_row: dict[int, list[bytes]] = {}
        for i, b in enumerate(self.val_iterator(local=False)):
            if self.cfg.train.eval_batches and i >= self.cfg.train.eval_batches:
                break
            for r in range(b["targets"].shape[0]):
                keep = (b["mask"][r] > 0) & (b["target_bytes"][r] > 0)
                per_row.setdefault(r, []).append(b["targets"][r][keep].astype(np.uint8).tobytes())
        return b"".join(b"".join(v) for _, v in sorted(per_row.items()))

    # --------------------------------------------------------------- sample
    def sample(self, state, prompt: str, num_tokens: int) -> str:
        """The text of `prompt` and its greedy continuation: `[bos] + encode(prompt)` (a
        prefix-LM model's bidirectional prefix), then at most `num_tokens` tokens, up to
        the tokenizer's EOS and within `train.seq_len` tokens in all. KV-cached
        (`tfjax.inference.generate`) on the trainer's mesh, one row per batch shard, the
        sequence whole on each device."""
        tok, T = self.tokenizer, self.cfg.train.seq_len
        ids = [tok.bos_id] + list(tok.encode(prompt))[: T - 1]
        num_tokens = min(num_tokens, T - len(ids))
        if num_tokens < 1:
            return tok.decode(ids[1:])
        rows, _ = _axes_size(self.mesh, self.rules, "batch")
        sharding = self.program.batch_sharding
        prompt_rows = np.tile(np.asarray(ids, np.int32), (rows, 1))
        tokens = jax.make_array_from_callback(prompt_rows.shape, sharding,
                                              lambda i: prompt_rows[i])
        # a decode step holds one token a row: "length" is not split (no context parallelism)
        rules = tuple((name, None if name == "length" else axes) for name, axes in self.rules)
        with use_rules(self.mesh, rules):
            out = generate(self.model(state), tokens, max_new_tokens=num_tokens,
                           eos_id=tok.eos_id)
        new = np.asarray(out.addressable_data(0))[0].tolist()  # every row is the same
        if tok.eos_id in new:
            new = new[:new.index(tok.eos_id)]
        return tok.decode(ids[1:] + new)

    # ------------------------------------------------------------------ loop
    def _on_sigterm(self, signum, frame):
        self._stop = True

    def _data_state(self, it: PackedBatches) -> dict:
        """The iterator state to checkpoint (collective with several processes). A
        process advances only the streams of its own rows, and orbax writes the JSON of
        process 0 alone, so each row's cursor is gathered from a process that holds it."""
        st = it.get_state()
        if jax.process_count() == 1 or "cursors" not in st:  # a cache mixture: the batch count
            return st
        from jax.experimental import multihost_utils

        mine = np.full((len(st["cursors"]), 2), -1, np.int32)
        mine[self.local_rows] = np.asarray(st["cursors"], np.int32)[self.local_rows]
        every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, B, 2]
        return dict(st, cursors=every.max(0).tolist())  # a row's holders agree; others -1

    def train(self) -> dict[str, Any]:
        """Run to `train.steps` (resuming from the latest checkpoint), compiling through
        the persistent cache `train.compilation_cache` names; returns the summary
        (final metrics, `compile_s`: the first step's compile + run, ...)."""
        with persistent_compilation_cache(self.cfg.train.compilation_cache, self.workdir):
            return self._train()

    def _train(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        log = self.log
        log(f"tfjax.train: {self.program.num_params / 1e6:.2f}M parameters, mesh "
            f"{dict(self.mesh.shape)}, {jax.process_count()} process(es), "
            f"{len(jax.devices())} {jax.devices()[0].platform} device(s), "
            f"global batch {t.batch_size} x {t.seq_len} tokens")
        for note in self.program.notes:
            if not note.startswith("['opt']"):  # optimizer moments mirror their parameters
                log(f"  note: {note}")
        state, data_state, start = self.restore_or_init()
        it = self.train_iterator()
        if data_state is not None:
            it.set_state(data_state)
            log(f"  resumed from step {start} ({self.checkpointer.directory})")
        writer = MetricWriter(self.workdir, resume_step=start, wandb=t.wandb,
                              wandb_mode=t.wandb_mode, config=_plain(cfg))
        profile = parse_profile_steps(t.profile_steps, t.steps)
        tracing = False
        clock = WallClock().__enter__()
        fpt = flops_per_token(cfg.model, t.seq_len)
        peak, peak_src = peak_flops(t.peak_flops)
        tokens_per_step = t.batch_size * t.seq_len
        bar = ProgressBar(t.steps, enabled=t.progress)
        old_handler = None
        self._preemption_sync = _preemption_sync_point(start)
        if self._preemption_sync is None:  # with the sync manager, its C++ handler must stay
            try:
                old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:  # not the main thread
                pass
        # config.json after the SIGTERM handler: once it exists, a SIGTERM saves and exits
        if jax.process_index() == 0:
            storage.path(self.workdir).mkdir(parents=True, exist_ok=True)
            storage.write_atomic(os.path.join(self.workdir, "config.json"),
                                 json.dumps(_plain(cfg), indent=1).encode())
        pending: list[tuple[int, dict]] = []
        last_t, last_step, compile_s = time.perf_counter(), start, None
        step = start
        preempted = False
        summary: dict[str, Any] = {}

        def flush():
            """Fetch the metrics of the steps since the last log; write one record."""
            nonlocal last_t, last_step
            if not pending:
                return
            vals = [(s, {k: float(v) for k, v in m.items()}) for s, m in pending]
            pending.clear()
            for s, v in vals:
                self.history[s] = v["loss"]
            now = time.perf_counter()
            rate_steps = step - last_step  # 0 right after the compile step
            dt = (now - last_t) / max(rate_steps, 1)
            last_t, last_step = now, step
            loss = float(np.mean([v["loss"] for _, v in vals]))
            nll = sum(v["nll_sum"] for _, v in vals)
            nbytes = sum(v["bytes"] for _, v in vals)
            rec = dict(loss=loss, bpb=nll / LN2 / max(nbytes, 1.0),
                       lr=float(self._lr(step - 1)), grad_norm=vals[-1][1]["grad_norm"])
            if not self.objective.bits_per_byte:  # no code length of text (objectives.py)
                del rec["bpb"]
            if self.objective.report is not None:  # e.g. TRL's rewards/* of preference runs
                rec.update(self.objective.report(
                    {k: sum(v[k] for _, v in vals) for k in ("tokens", *self.objective.extra)}))
            if "correct" in vals[0][1]:
                rec["accuracy"] = (sum(v["correct"] for _, v in vals)
                                   / max(sum(v["tokens"] for _, v in vals), 1.0))
            if rate_steps > 0:
                tps = tokens_per_step / dt
                rec.update(tokens_per_s=tps, step_time_s=dt, mfu=fpt * tps / peak if peak else 0.0)
            rec.update(it.data_tokens(step))  # data_tokens/<cache>: a cache mixture's draws
            if t.z_loss:
                rec["z_loss"] = float(np.mean([v["z"] for _, v in vals]))
            if self.cfg.model.mtp_depth:  # weighted multi-token prediction loss per token
                rec["mtp_loss"] = float(np.mean([v["mtp"] for _, v in vals]))
            writer.write(step, **rec, **clock.split())
            speed = (f" {rec['tokens_per_s']:,.0f} tok/s mfu {100 * rec['mfu']:.1f}%"
                     if "mfu" in rec else "")
            shown = "".join(f" {k} {rec[k]:.3f}" for k in ("bpb", "accuracy", "rewards/accuracies",
                                                            "rewards/margins") if k in rec)
            bar.update(step, f"loss {loss:.3f}{shown} lr {rec['lr']:.2e} "
                             f"|g| {rec['grad_norm']:.2f}{speed}")

        try:
            while step < t.steps:
                if self._should_stop(step):
                    flush()
                    if cfg.checkpoint.enabled:
                        self.checkpointer.save(step, state, self._data_state(it), wait=True)
                    msg = f"SIGTERM: saved step {step}; rerun the same command to resume"
                    if jax.process_count() > 1:  # every host's log says where it stopped
                        print(f"\n[process {jax.process_index()}] {msg}", flush=True)
                    else:
                        log("\n" + msg)
                    preempted = True
                    break
                with clock.timing("data"):
                    batch = self.global_batch(next(it))
                if profile and not tracing and profile[0] <= step + 1 <= profile[1]:
                    jax.profiler.start_trace(os.path.join(self.workdir, "profile"))
                    tracing = True
                with (jax.profiler.StepTraceAnnotation("train", step_num=step + 1) if tracing
                      else contextlib.nullcontext()):
                    state, metrics = self.program.step(state, batch)
                step += 1
                pending.append((step, metrics))
                if tracing and step == profile[1]:
                    jax.block_until_ready(metrics)
                    jax.profiler.stop_trace()
                    tracing = False
                    log(f"\n  jax.profiler trace of steps {profile[0]}-{step}: "
                        f"{os.path.join(self.workdir, 'profile')}")
                if compile_s is None:
                    jax.block_until_ready(metrics)
                    compile_s = time.perf_counter() - last_t
                    last_t, last_step = time.perf_counter(), step
                    log(f"  first step (compile + run): {compile_s:.1f}s")
                if step % t.log_every == 0 or step == t.steps:
                    flush()
                if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                    with clock.timing("eval"):
                        ev = self.evaluate(state)
                    writer.write(step, **{k: v for k, v in ev.items() if k != "val_bytes"})
                    log(f"\n  eval @ {step}: {eval_line(ev, final=False)}")
                    last_t = time.perf_counter()
                every = cfg.checkpoint.every_steps
                if cfg.checkpoint.enabled and every and step % every == 0 and step < t.steps:
                    with clock.timing("checkpoint"):
                        self.checkpointer.save(step, state, self._data_state(it))
                        writer.sync()  # a workdir on a bucket: the records a resume keeps
            bar.close()
            if not preempted and cfg.checkpoint.enabled:
                with clock.timing("checkpoint"):
                    self.checkpointer.save(step, state, self._data_state(it), wait=True)
            if not preempted and t.eval_at_end:
                with clock.timing("eval"):
                    ev = self.evaluate(state)
                writer.write(step, **{k: v for k, v in ev.items() if k != "val_bytes"},
                             **clock.split())
                summary.update(ev)
                log(f"step {step}: {eval_line(ev, final=True)}")
                byte_level = self.tokenizer.__class__.__name__ == "ByteTokenizer"
                if self.objective.compression and byte_level:
                    base, line = compression_report(
                        ev["val_bpb"], self.validation_bytes() if ev["val_bytes"] else b"")
                    summary.update(base)
                    log(line)
            if not preempted:
                if t.sample_tokens and self.objective.samples:
                    text = self.sample(state, t.sample_prompt, t.sample_tokens)
                    summary["sample"] = text
                    log("sample (greedy):\n" + text)
                log(f"MFU peak: {peak / 1e9:.1f} GFLOP/s ({peak_src}); "
                    f"{fpt / 1e6:.2f} MFLOP per trained token")
            clock.split()
            summary["wall_time"] = dict(clock.totals)
            log("wall time: " + ", ".join(f"{k[5:-2]} {v:.1f}s" for k, v in
                                          clock.totals.items() if k.startswith("time_")))
        finally:
            if tracing:
                jax.profiler.stop_trace()
            clock.__exit__(None, None, None)
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
            self.checkpointer.close()
            writer.close()
        summary.update(step=step, preempted=preempted, history=dict(self.history),
                       compile_s=compile_s)
        self.state = state
        return summary

    def _should_stop(self, step: int) -> bool:
        """Save and exit before `step`? Every process must answer the same at the same
        step (a save is collective). Asked before every step."""
        if jax.process_count() == 1 and self._stop:
            return True
        if self._preemption_sync is not None:
            # JAX's preemption sync point: a mutex and a compare, so asked every step; it
            # is True at the same step on every process once any one of them got SIGTERM.
            return self._preemption_sync(step)
        if jax.process_count() == 1:
            return self._stop
        # Fallback, several processes without the sync manager (jax without
        # `reached_preemption_sync_point`, or `jax_enable_preemption_service=False`):
        # our Python handler's flag, gathered from every process every `log_every`
        # steps (a collective, so not every step); a SIGTERM acts within log_every steps.
        if step % max(self.cfg.train.log_every, 1):
            return False
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.array(self._stop, np.int32))
        return bool(np.any(flags))


def _preemption_sync_point(start: int) -> Callable[[int], bool] | None:
    """`multihost_utils.reached_preemption_sync_point` when this process runs JAX's
    preemption sync manager, else None (then the trainer installs a Python handler).

    How it works (read in jax / xla sources for jax 0.10.2): `jax.distributed.initialize`
    creates the coordination service's PreemptionSyncManager; its notifier installs a C++
    SIGTERM handler (`std::signal`) that only sets a flag, polled once a second by a
    listener thread. The process that got SIGTERM writes a notice into the coordination
    service's key-value store; on every process a background thread then publishes the
    last step passed to `reached_preemption_sync_point(step)` (and blocks further calls),
    meets the others at a barrier and takes the largest + 1 as the sync step, where
    `reached_preemption_sync_point` returns True on every process. It must be called with
    every step, the same sequence on every process (orbax's save calls it with the saved
    step too; its async finalize thread may do so a step late, a narrow race orbax-based
    trainers share). A Python `signal.signal(SIGTERM, ...)` installed after
    `initialize` replaces the C++ handler and the notifier never fires (`signal.getsignal`
    does not even show it), so with the sync manager nothing here touches SIGTERM.
    Known gap: a notice that arrives before a *resumed* run's first call sets the sync
    step below `start`; that SIGTERM is not acted on (the previous checkpoint stands).
    """
    try:
        from jax.experimental.multihost_utils import reached_preemption_sync_point

        if not jax.distributed.is_initialized():
            return None
        reached_preemption_sync_point(start)  # RuntimeError: the sync manager is off
    except (ImportError, AttributeError, RuntimeError):
        return None
    return reached_preemption_sync_point


def _plain(x):
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x
