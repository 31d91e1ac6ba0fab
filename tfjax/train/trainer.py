"""The one training loop of tfjax (`python -m tfjax.train`).

    cfg = tfjax.config.run_config(get_config())
    Trainer(cfg, workdir).train()

What happens, in order:
1. Every setting is checked against the devices (mesh product, batch and sequence
   divisibility, vocabulary, unknown logical axes) before anything compiles.
2. The mesh (`data, fsdp, sequence, tensor, expert`) and the rules table map the
   model's logical axis names to `NamedSharding`s; parameters and optimizer state
   are created *inside* a jit whose out_shardings are those, so nothing is ever
   materialised whole on one device.
3. The pure step (`step.py`) is jitted with in/out shardings and donated state.
4. Data (`tfjax.data`) is packed into rows; each process builds only the rows its
   devices hold and they are assembled into one global array. With ring attention
   over a sequence axis of n devices and `model.zigzag="data"`, every per-token
   array of the batch is put in zig-zag order on the host first (`zigzag_devices`),
   and the steps are traced under `tfjax.parallel.zigzag.zigzag_data(n)`.
5. orbax saves state and data position every `checkpoint.every_steps` and at the
   end; rerunning the same command resumes exactly. SIGTERM saves, then exits (the
   CLI with 143); sent to any one process of a multi-process run, it stops every
   process at the same step through JAX's preemption sync point (checked every step).
6. Metrics go to the terminal (progress bar), WORKDIR/metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tfjax.config import RunConfig
from tfjax.data.pipeline import BATCH_KEYS, PackedBatches
from tfjax.data.sources import documents
from tfjax.data.tokenizers import load_tokenizer
from tfjax.models import FFN_KINDS, LAYER_KINDS, build, check_names
from tfjax.parallel.mesh import make_mesh
from tfjax.parallel.rules import logical_rules, replicated, tree_shardings
from tfjax.parallel.sharding import logical_to_spec, use_rules
from tfjax.parallel.zigzag import zigzag_data, zigzag_order
from tfjax.train.checkpoint import Checkpointer, abstract_with_shardings
from tfjax.train.losses import LN2
from tfjax.train.metrics import MetricWriter, ProgressBar, flops_per_token, peak_flops
from tfjax.train.optim import lr_schedule, make_optimizer
from tfjax.train.step import make_eval_step, make_train_step

__all__ = ["Program", "Trainer", "build_program", "check_run", "compression_bits_per_byte",
           "zigzag_devices", "zigzag_rows"]


def _axes_size(mesh, rules, name: str) -> tuple[int, tuple[str, ...]]:
    axes = tuple(a for a in (dict(rules).get(name) or ()))
    return math.prod(mesh.shape[a] for a in axes), axes


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
    if m.arch != "decoder":
        raise ValueError(f"model.arch: the trainer trains decoder language models; got "
                         f"{m.arch!r} (encoder / encoder_decoder objectives are not wired yet)")
    if t.batch_size % jax.process_count():
        raise ValueError(f"train.batch_size: {t.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")


def zigzag_devices(cfg: RunConfig, mesh, build_model=None) -> tuple[int, str | None]:
    """(n, note): n > 0 when the trainer feeds batches in zig-zag order over the n
    devices of the sequence axis (`model.zigzag="data"`, ring attention, seq_len % 2n
    == 0, a `tfjax.models.build` model), else 0. `note` says why "data" fell back to
    natural order: layers whose result depends on token order other than through
    attention's position-aware mask and position biases would see the tokens out of
    order (their layer kind or ffn kind record says so: `order_dependent`,
    `order_dependence`; ALiBi and T5's bias read the reordered positions in the ring
    itself), and a custom `build_model` (e.g. a test double) may derive its mask or
    positions from the array index."""
    m, t = cfg.model, cfg.train
    axes = [a for a in (dict(logical_rules(cfg.mesh.rules)).get("length") or ())
            if mesh.shape[a] > 1]
    if m.zigzag != "data" or m.context_parallel != "ring" or len(axes) != 1:
        return 0, None
    n = mesh.shape[axes[0]]
    why = [f"layer_pattern has {k!r} layers" for k in dict.fromkeys(m.layer_pattern)
           if LAYER_KINDS.get(k, field="model.layer_pattern").order_dependent]
    if build_model is not None and build_model is not build:
        why.append("a custom build_model, which may not read positions from the batch")
    why += [reason for k in dict.fromkeys(m.ffn_pattern)
            if (reason := FFN_KINDS.get(k, field="model.ffn_pattern").order_dependence(m))]
    if t.seq_len % (2 * n):
        why.append(f"train.seq_len={t.seq_len} is not divisible by 2 x {n} sequence devices")
    if why:
        return 0, (f"model.zigzag='data' not applied ({'; '.join(why)}): batches stay in "
                   f"natural order; attention runs as with model.zigzag='layer'")
    return n, None


def zigzag_rows(x: np.ndarray, n: int) -> np.ndarray:
    """`tfjax.parallel.zigzag.zigzag(x, n, axis=1)` in numpy, for a host batch `[B, T]`."""
    B, T = x.shape
    return x.reshape(B, 2 * n, T // (2 * n))[:, zigzag_order(n)].reshape(B, T)


def compression_bits_per_byte(data: bytes) -> dict[str, float]:
    """Bits per byte of gzip -9 and xz -9e on `data` (the baselines to beat)."""
    n = max(len(data), 1)
    return dict(gzip=len(gzip.compress(data, 9)) * 8 / n,
                xz=len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * 8 / n)


@dataclasses.dataclass
class Program:
    """The compiled-to-be pieces of a run on a mesh: jitted init / train step / eval step
    with their shardings (what `--compile_only` lowers for a TPU topology)."""

    graphdef: Any
    eval_graphdef: Any
    tx: Any
    abstract_state: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    notes: list
    num_params: int
    init: Callable
    step: Callable
    eval: Callable
    zigzag: int = 0  # > 0: batches must be in zig-zag order over this many devices


def build_program(cfg: RunConfig, mesh, build_model) -> Program:
    """Abstract model -> shardings (unknown logical axes fail here, before compiling) ->
    the jitted, sharded, donating train step."""
    rules = logical_rules(cfg.mesh.rules)
    t = cfg.train

    def make_model():
        with nnx.use_eager_sharding(False):
            return build_model(cfg.model, rngs=nnx.Rngs(cfg.seed))

    abstract = nnx.eval_shape(make_model)
    graphdef, aparams, arest = nnx.split(abstract, nnx.Param, ...)
    abstract.eval()
    eval_graphdef = nnx.split(abstract, nnx.Param, ...)[0]
    tx = make_optimizer(t)
    aopt = jax.eval_shape(tx.init, aparams)
    abstract_state = dict(step=jax.ShapeDtypeStruct((), jnp.int32), params=aparams, opt=aopt,
                          rest=arest)
    notes: list[str] = []
    state_shardings = tree_shardings(abstract_state, mesh, rules, notes)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(aparams))

    def init():
        with use_rules(mesh, rules):
            model = make_model()
            _, params, rest = nnx.split(model, nnx.Param, ...)
            return dict(step=jnp.zeros((), jnp.int32), params=params, opt=tx.init(params),
                        rest=rest)

    # Batches: [B, T] split over the "batch" mesh axes; the step itself constrains
    # activations to ("batch", "length") (sequence sharding).
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", None), rules))
    rep = replicated(mesh)
    zz, note = zigzag_devices(cfg, mesh, build_model)
    if note:
        notes.append(note)

    def traced(f):  # the layers read the data layout while jit traces the step
        if not zz:
            return f

        def g(*args):
            with zigzag_data(zz):
                return f(*args)
        return g

    return Program(
        graphdef=graphdef, eval_graphdef=eval_graphdef, tx=tx, abstract_state=abstract_state,
        state_shardings=state_shardings, batch_sharding=batch_sharding, notes=notes,
        num_params=num_params,
        init=jax.jit(init, out_shardings=state_shardings),
        zigzag=zz,
        step=jax.jit(traced(make_train_step(graphdef, tx, t, mesh, rules)),
                     in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, rep), donate_argnums=0),
        eval=jax.jit(traced(make_eval_step(eval_graphdef, mesh, rules)),
                     in_shardings=(state_shardings, batch_sharding), out_shardings=rep))


class Trainer:
    """Builds everything from a validated `RunConfig`; `train()` runs the loop."""

    def __init__(self, cfg: RunConfig, workdir: str, *,
                 build_model: Callable[..., nnx.Module] | None = None,
                 devices=None, log: Callable[[str], None] | None = None):
        self.cfg = cfg.validate()
        self.workdir = workdir
        self.log = log or (lambda s: print(s, flush=True) if jax.process_index() == 0 else None)
        check_names(cfg.model)  # registry-owned names, before anything is built
        self.build_model = build_model or build
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.mesh = make_mesh(cfg.mesh, devices)
        self.rules = logical_rules(cfg.mesh.rules)
        check_run(cfg, self.mesh, self.tokenizer)
        t = cfg.train
        self.train_docs = documents(cfg.data, "train")
        self.val_docs = documents(cfg.data, "validation")
        p = build_program(cfg, self.mesh, self.build_model)
        self.graphdef, self.eval_graphdef, self.tx = p.graphdef, p.eval_graphdef, p.tx
        self.abstract_state, self.state_shardings = p.abstract_state, p.state_shardings
        self.batch_sharding, self.notes, self.num_params = p.batch_sharding, p.notes, p.num_params
        self._init, self._step, self._eval = p.init, p.step, p.eval
        self.zigzag = p.zigzag
        self.local_rows = self._local_rows(t.batch_size)
        self._lr = lr_schedule(t)
        self.checkpointer = Checkpointer(workdir, cfg.checkpoint)
        self.history: dict[int, float] = {}
        self._stop = False  # set by the Python SIGTERM handler (when one is installed)
        self._preemption_sync: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ data
    def _local_rows(self, batch: int) -> list[int]:
        index_map = self.batch_sharding.addressable_devices_indices_map((batch, 1))
        rows: set[int] = set()
        for idx in index_map.values():
            rows.update(range(*idx[0].indices(batch)))
        return sorted(rows)

    def train_iterator(self) -> PackedBatches:
        t = self.cfg.train
        return PackedBatches(self.train_docs, self.tokenizer, seq_len=t.seq_len,
                             global_batch=t.batch_size, local_rows=self.local_rows,
                             seed=self.cfg.seed, shuffle=self.cfg.data.shuffle, repeat=True)

    def val_iterator(self, local: bool = True) -> PackedBatches:
        t = self.cfg.train
        return PackedBatches(self.val_docs, self.tokenizer, seq_len=t.seq_len,
                             global_batch=t.batch_size,
                             local_rows=self.local_rows if local else None,
                             shuffle=False, repeat=False)

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays sharded over the batch axes (in zig-zag
        order along the sequence when `self.zigzag`, as the compiled steps expect)."""
        t = self.cfg.train
        if self.zigzag:
            local = {k: zigzag_rows(local[k], self.zigzag) for k in BATCH_KEYS}
        where = {r: i for i, r in enumerate(self.local_rows)}

        def one(x):
            def piece(idx):
                rows = range(*idx[0].indices(t.batch_size))
                return x[[where[r] for r in rows]][:, idx[1]]
            return jax.make_array_from_callback((t.batch_size, t.seq_len), self.batch_sharding, piece)

        return {k: one(local[k]) for k in BATCH_KEYS}

    # ----------------------------------------------------------------- state
    def init_state(self):
        return self._init()

    def restore_or_init(self):
        """(state, data_state, step): the latest checkpoint in WORKDIR, or a fresh start."""
        if self.cfg.checkpoint.enabled and self.cfg.checkpoint.resume:
            abstract = abstract_with_shardings(self.abstract_state, self.state_shardings)
            got = self.checkpointer.restore(abstract)
            if got is not None:
                state, data_state, step = got
                return state, data_state, step
        return self.init_state(), None, 0

    # ------------------------------------------------------------- evaluate
    def evaluate(self, state) -> dict[str, float]:
        """val_loss (nats/token) and val_bpb over `train.eval_batches` batches (0: all)
        of the validation split, read in order."""
        sums = dict(nll=0.0, tokens=0.0, bytes=0.0)
        for i, local in enumerate(self.val_iterator()):
            if self.cfg.train.eval_batches and i >= self.cfg.train.eval_batches:
                break
            out = self._eval(state, self.global_batch(local))
            for k in sums:
                sums[k] += float(out[k])
        return dict(val_loss=sums["nll"] / max(sums["tokens"], 1.0),
                    val_bpb=sums["nll"] / LN2 / max(sums["bytes"], 1.0),
                    val_bytes=sums["bytes"])

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
        """Greedy continuation of `prompt`, recomputing the whole window each token (one
        compile; a causal model's logits at position t ignore the padding after t)."""
        T = self.cfg.train.seq_len
        ids = list(self.tokenizer.encode(prompt))[: T - 1]
        ids = [self.tokenizer.bos_id] + ids
        num_tokens = min(num_tokens, T - len(ids))
        graphdef = self.eval_graphdef

        def next_id(params, rest, tokens, cur):
            with use_rules(self.mesh, self.rules):
                model = nnx.merge(graphdef, params, rest)
                B = tokens.shape[0]
                logits = model(tokens, positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
                               segment_ids=jnp.ones((B, T), jnp.int32))
                return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, cur - 1, 1, False), -1)

        f = jax.jit(next_id, in_shardings=(self.state_shardings["params"],
                                           self.state_shardings["rest"], self.batch_sharding, None),
                    out_shardings=replicated(self.mesh))
        rows, _ = _axes_size(self.mesh, self.rules, "batch")  # one row per batch shard
        buf = np.full((rows, T), self.tokenizer.pad_id, np.int32)
        start = len(ids)
        buf[:, :start] = ids
        for cur in range(start, start + num_tokens):
            tokens = jax.make_array_from_callback(buf.shape, self.batch_sharding, lambda i: buf[i])
            nxt = int(np.asarray(f(state["params"], state["rest"], tokens, cur))[0])
            if nxt == self.tokenizer.eos_id:
                break
            buf[:, cur] = nxt
            ids.append(nxt)
        return self.tokenizer.decode(ids[1:])

    # ------------------------------------------------------------------ loop
    def _on_sigterm(self, signum, frame):
        self._stop = True

    def _data_state(self, it: PackedBatches) -> dict:
        """The iterator state to checkpoint (collective with several processes). A
        process advances only the streams of its own rows, and orbax writes the JSON of
        process 0 alone, so each row's cursor is gathered from a process that holds it."""
        st = it.get_state()
        if jax.process_count() == 1:
            return st
        from jax.experimental import multihost_utils

        mine = np.full((len(st["cursors"]), 2), -1, np.int32)
        mine[self.local_rows] = np.asarray(st["cursors"], np.int32)[self.local_rows]
        every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, B, 2]
        return dict(st, cursors=every.max(0).tolist())  # a row's holders agree; others -1

    def train(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        log = self.log
        log(f"tfjax.train: {self.num_params / 1e6:.2f}M parameters, mesh "
            f"{dict(self.mesh.shape)}, {jax.process_count()} process(es), "
            f"{len(jax.devices())} {jax.devices()[0].platform} device(s), "
            f"global batch {t.batch_size} x {t.seq_len} tokens")
        for note in self.notes:
            if not note.startswith("['opt']"):  # optimizer moments mirror their parameters
                log(f"  note: {note}")
        state, data_state, start = self.restore_or_init()
        it = self.train_iterator()
        if data_state is not None:
            it.set_state(data_state)
            log(f"  resumed from step {start} ({self.checkpointer.directory})")
        writer = MetricWriter(self.workdir, resume_step=start)
        if jax.process_index() == 0:
            os.makedirs(self.workdir, exist_ok=True)
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                json.dump(_plain(cfg), f, indent=1)
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
            if rate_steps > 0:
                tps = tokens_per_step / dt
                rec.update(tokens_per_s=tps, step_time_s=dt, mfu=fpt * tps / peak if peak else 0.0)
            if t.z_loss:
                rec["z_loss"] = float(np.mean([v["z"] for _, v in vals]))
            writer.write(step, **rec)
            speed = (f" {rec['tokens_per_s']:,.0f} tok/s mfu {100 * rec['mfu']:.1f}%"
                     if "mfu" in rec else "")
            bar.update(step, f"loss {loss:.3f} bpb {rec['bpb']:.3f} lr {rec['lr']:.2e} "
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
                batch = self.global_batch(next(it))
                state, metrics = self._step(state, batch)
                step += 1
                pending.append((step, metrics))
                if compile_s is None:
                    jax.block_until_ready(metrics)
                    compile_s = time.perf_counter() - last_t
                    last_t, last_step = time.perf_counter(), step
                    log(f"  first step (compile + run): {compile_s:.1f}s")
                if step % t.log_every == 0 or step == t.steps:
                    flush()
                if t.eval_every and step % t.eval_every == 0 and step < t.steps:
                    ev = self.evaluate(state)
                    writer.write(step, val_loss=ev["val_loss"], val_bpb=ev["val_bpb"])
                    log(f"\n  eval @ {step}: val_loss {ev['val_loss']:.4f} "
                        f"val_bpb {ev['val_bpb']:.4f}")
                    last_t = time.perf_counter()
                every = cfg.checkpoint.every_steps
                if cfg.checkpoint.enabled and every and step % every == 0 and step < t.steps:
                    self.checkpointer.save(step, state, self._data_state(it))
            bar.close()
            if not preempted and cfg.checkpoint.enabled:
                self.checkpointer.save(step, state, self._data_state(it), wait=True)
            if not preempted and t.eval_at_end:
                ev = self.evaluate(state)
                writer.write(step, val_loss=ev["val_loss"], val_bpb=ev["val_bpb"])
                summary.update(ev)
                log(f"step {step}: val_loss {ev['val_loss']:.4f} nats/token, "
                    f"val_bpb {ev['val_bpb']:.4f} bits/byte on {int(ev['val_bytes']):,} "
                    f"validation bytes")
                if self.tokenizer.__class__.__name__ == "ByteTokenizer":
                    base = compression_bits_per_byte(self.validation_bytes())
                    summary.update({f"{k}_bpb": v for k, v in base.items()})
                    log(f"  same bytes: gzip -9 {base['gzip']:.4f} bits/byte, "
                        f"xz -9e {base['xz']:.4f} bits/byte; tfjax "
                        f"{'beats' if ev['val_bpb'] < base['gzip'] else 'does not beat'} gzip")
            if not preempted:
                if t.sample_tokens:
                    text = self.sample(state, t.sample_prompt, t.sample_tokens)
                    summary["sample"] = text
                    log("sample (greedy):\n" + text)
                log(f"MFU peak: {peak / 1e9:.1f} GFLOP/s ({peak_src}); "
                    f"{fpt / 1e6:.2f} MFLOP per trained token")
        finally:
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
