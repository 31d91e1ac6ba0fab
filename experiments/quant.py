"""Quantization measured: the train step of Llama-3.2-1B with `model.quant` none (bf16
compute) / int8 / fp8 and its decode step with int8 / int4 weights and an int8 K/V cache,
both compiled by the real XLA:TPU compiler on this CPU (libtpu topologies, no TPU: XLA's
step-time estimate, per-chip memory, 8-bit dots); and on this CPU the perplexity of a
tiny model trained here, float against int8 / int4 weights and an int8 K/V cache.

    .venv/bin/python experiments/quant.py                    # all parts, 1B on v5e and v6e
    .venv/bin/python experiments/quant.py --parts decode --topologies v5e:2x2
    .venv/bin/python experiments/quant.py --parts estimate,dots  # train step time, priced
    JAX_PLATFORMS=cpu .venv/bin/python experiments/quant.py --parts ppl
    JAX_PLATFORMS=cpu .venv/bin/python experiments/quant.py --parts quality --workdir W
    .venv/bin/python experiments/quant.py --quick            # Llama tiny on v5e:2x2

Point: configs/llama.py "1b" (bf16 compute, float32 parameters and AdamW, full remat,
the chunked loss), global batch 8 x 2048 tokens, FSDP over the 4 chips. The 8-bit dots
are counted from the optimized HLO's operand types (as tests/train/test_quant_train.py).
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import glob
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from common import HERE, Experiment, preset_config
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tfjax import config as C
from tfjax import models
from tfjax.config import run_config
from tfjax.inference import generate
from tfjax.nn.quant import quantize_for_serving, weight_bytes
from tfjax.train.aot import (compile_step, estimated_seconds, step_figures, tpu_devices,
                             xla_cost)
from tfjax.train.checkpoint import load_run
from tfjax.train.objectives import OBJECTIVES, eval_metrics
from tfjax.train.trainer import Trainer

GiB = 1024 ** 3
FORMATS = ("none", "int8", "fp8")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[")
_DOT = re.compile(r"\b(?:dot|convolution)\(([^)]*)\)")


def dot_operand_types(hlo: str) -> collections.Counter:
    types = {m.group(1): m.group(2) for m in map(_DEF.match, hlo.splitlines()) if m}
    out = collections.Counter()
    for line in hlo.splitlines():
        if m := _DOT.search(line):
            out[tuple(types.get(n.strip().lstrip("%"), "?") for n in m.group(1).split(","))] += 1
    return out


def eight_bit(ops: collections.Counter) -> int:
    """How many of `dot_operand_types`' dots take an 8-bit (s8 / f8) operand."""
    return sum(n for k, n in ops.items() if any(t.startswith(("s8", "f8")) for t in k))


def one_chip(device) -> NamedSharding:
    """Arrays whole on `device` (one chip of a compile-only topology)."""
    return NamedSharding(Mesh(np.asarray([device]), ("data",)), P())


def row(variant: str, topology: str, quant: str, batch: int, seq: int) -> dict:
    cfg = preset_config("llama", variant)
    cfg.model.update(dict(dtype="bfloat16", remat="full", quant=quant))
    cfg.train.update(dict(batch_size=batch, seq_len=seq, loss_chunk=512, microbatches=1))
    cfg.mesh.update(dict(data=1, fsdp=4))
    start = time.time()
    compiled, p, _, _ = compile_step(run_config(cfg), topology)
    f = step_figures(compiled, p)
    cost = xla_cost(compiled)
    print(topology, quant, {k: cost.get(k) for k in ("optimal_seconds", "flops",
                                                     "bytes accessed", "utilization")},
          flush=True)
    ops = dot_operand_types(compiled.as_text())
    eight = eight_bit(ops)
    return dict(optimal_seconds=f["optimal_seconds"], temp=f["temp"],
                raw_seconds=float(cost.get("optimal_seconds", 0.0) or 0.0),
                tflops=float(cost.get("flops", 0.0) or 0.0) / 1e12,
                total=f["arguments"] + f["temp"] + f["code"], dots=sum(ops.values()),
                eight_bit=eight, compile_s=time.time() - start)


def layer_row(variant: str, topology: str, quant: str, layers: int, batch: int,
              seq: int) -> dict:
    """XLA's estimate of the train step of `variant` cut to `layers` layers, every op
    priced: the stack unrolled (a scanned body counts once), the loss in one piece
    (`loss_chunk=0`: its loop too), attention in XLA (a Mosaic kernel counts ~0)."""
    cfg = preset_config("llama", variant)
    cfg.model.update(dict(dtype="bfloat16", remat="full", quant=quant, num_layers=layers,
                          scan_layers=False))
    cfg.model.attention.update(dict(impl="xla"))
    cfg.train.update(dict(batch_size=batch, seq_len=seq, loss_chunk=0, microbatches=1))
    cfg.mesh.update(dict(data=1, fsdp=4))
    start = time.time()
    compiled, _, _, _ = compile_step(run_config(cfg), topology)
    cost = xla_cost(compiled)
    ops = dot_operand_types(compiled.as_text())
    seconds = estimated_seconds(compiled)
    out = dict(seconds=seconds, tflops=float(cost.get("flops", 0)) / 1e12,
               unpriced=round(seconds - float(cost.get("optimal_seconds", 0.0) or 0.0)),
               eight_bit=eight_bit(ops),
               dots=sum(ops.values()), compile_s=time.time() - start)
    print(topology, quant, layers, out, flush=True)
    return out


def estimate_table(exp, variant, topologies, batch, seq):
    """The whole step's estimate from two unrolled depths: the step of L layers is
    priced at a + b L (the layers are alike), so the full depth's is read off the line
    through 1 and 2 layers."""
    depth = preset_config("llama", variant).model.num_layers
    table = []
    for topology in topologies:
        base = None
        for quant in FORMATS:
            one, two = (layer_row(variant, topology, quant, n, batch, seq) for n in (1, 2))
            per_layer = two["seconds"] - one["seconds"]
            whole = one["seconds"] + (depth - 1) * per_layer
            flops = one["tflops"] + (depth - 1) * (two["tflops"] - one["tflops"])
            base = base or dict(whole=whole, per_layer=per_layer)
            table.append([topology, quant, one["seconds"] * 1e3, two["seconds"] * 1e3,
                          per_layer * 1e3, per_layer / base["per_layer"], whole * 1e3,
                          whole / base["whole"], flops, f"{two['eight_bit']} / {two['dots']}",
                          two["unpriced"], one["compile_s"] + two["compile_s"]])
            print(table[-1], flush=True)
    exp.table(["topology", "model.quant", "1 layer ms", "2 layers ms", "a layer ms",
               "a layer / bf16", f"{depth} layers ms", f"{depth} layers / bf16",
               f"XLA TFLOP ({depth} layers)", "8-bit dots / dots (2 layers)",
               "ConcatBitcast (-1 s each, added back)", "compile s"], table,
              title=f"Llama-3.2-1B ({variant}) train step, batch {batch} x {seq}, fsdp 4, "
                    f"per chip: XLA:TPU's estimate with every op priced (stack unrolled, "
                    f"loss in one piece, attention in XLA), {depth} layers read off 1 and 2")


def dots_table(exp, topologies, m=8192, k=2048, n=8192):
    """What XLA's cost model charges for one `[m, k] x [k, n]` matmul in bf16, in s8 and
    with both operands quantized first (int8 training's forward dot), one chip."""

    def quantized(x):  # per row, symmetric
        scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
        return jnp.round(x / scale).astype(jnp.int8), scale

    def int8_training_dot(a, b):
        (qa, sa), (qb, sb) = quantized(a), quantized(b.T)
        out = jnp.dot(qa, qb.T, preferred_element_type=jnp.int32)
        return (out * sa * sb.T).astype(jnp.bfloat16)

    kinds = (("bf16 x bf16", jnp.bfloat16,
              lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
             ("s8 x s8", jnp.int8, lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32)),
             ("bf16 quantized to s8, then s8 x s8", jnp.bfloat16, int8_training_dot))
    table = []
    for topology in topologies:
        rep = one_chip(tpu_devices(topology)[0][0])
        base = None
        for label, dtype, f in kinds:
            args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rep) for shape in ((m, k), (k, n))]
            compiled = jax.jit(f).lower(*args).compile()
            seconds = estimated_seconds(compiled)
            base = base or seconds
            table.append([topology, label, seconds * 1e6, seconds / base,
                          2 * m * k * n / seconds / 1e12])
    exp.table(["topology", "matmul", "XLA estimate us", "/ bf16", "TFLOP/s (TOPS) it implies"],
              table, title=f"one [{m}, {k}] x [{k}, {n}] matmul, one chip, XLA:TPU's estimate")


# decode variants: (label, --quantize, --quantize_group, --kv_quant)
DECODE = (("bf16", "none", None, "none"), ("int8 weights", "int8", None, "none"),
          ("int8 KV", "none", None, "int8"), ("int8 weights + int8 KV", "int8", None, "int8"),
          ("int4 weights", "int4", None, "none"), ("int4 (g128) weights", "int4", 128, "none"),
          ("int4 (g128) weights + int8 KV", "int4", 128, "int8"))


def decode_row(variant: str, topology: str, weights: str, group, kv: str, batch: int,
               max_len: int) -> dict:
    """The one-token decode step of `variant` (bf16 parameters and compute, scanned
    layers) over a cache of `batch` x `max_len`, compiled for one chip of `topology`."""
    cfg = preset_config("llama", variant)
    cfg.model.update(dict(dtype="bfloat16", param_dtype="bfloat16"))
    mcfg = run_config(cfg).model
    device = tpu_devices(topology)[0][0]
    rep = one_chip(device)

    def make():
        model = models.build(mcfg, rngs=nnx.Rngs(0))
        return quantize_for_serving(model, weights=weights, group=group, kv=kv,
                                    device=device)

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(make)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    abstract = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t)

    def decode(state, cache, tokens):
        return nnx.merge(graphdef, state).step(tokens, cache)

    start = time.time()
    compiled = jax.jit(decode, donate_argnums=1).lower(
        abstract(state), abstract(cache), jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                                                               sharding=rep)).compile()
    mem = compiled.memory_analysis()
    cost = xla_cost(compiled)
    return dict(params=weight_bytes(model),  # int4 values at half a byte, as XLA packs them
                cache=models.cache_bytes(model.config, batch, max_len),
                arguments=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
                optimal=estimated_seconds(compiled),
                bytes_accessed=float(cost.get("bytes accessed", 0.0) or 0.0),
                compile_s=time.time() - start)


def decode_table(exp, variant, topologies, batch, max_len):
    table = []
    for topology in topologies:
        base = None
        for label, weights, group, kv in DECODE:
            if exp.quick and group:  # Llama tiny's d_model 64: groups of 32
                label, group = label.replace(f"g{group}", "g32"), 32
            r = decode_row(variant, topology, weights, group, kv, batch, max_len)
            base = base or r
            table.append([topology, label, r["params"] / GiB, r["cache"] / GiB,
                          r["cache"] / base["cache"], r["arguments"] / GiB, r["temp"] / GiB,
                          (r["arguments"] + r["temp"]) / (base["arguments"] + base["temp"]),
                          r["optimal"] * 1e3 if r["optimal"] > 0 else "—",
                          r["bytes_accessed"] / GiB, r["compile_s"]])
            print(table[-1], flush=True)
    exp.table(["topology", "decode", "params GiB", "KV cache GiB", "KV / bf16",
               "arguments GiB", "temp GiB", "memory / bf16", "optimal ms",
               "XLA bytes accessed GiB", "compile s"], table,
              title=f"Llama-3.2-1B ({variant}) decode step, batch {batch} x {max_len} tokens "
                    f"of cache, one chip, XLA:TPU (libtpu topologies on this CPU)")


CORPUS = os.path.join(HERE, "..", "docs")


def trained_tiny(workdir: str, steps: int, train_paths, val_paths):
    """(model, run config) of a byte-level 2-layer d=64 decoder trained here for `steps`."""
    cfg = C.from_dict(C.RunConfig, dict(
        model=dict(vocab_size=259, d_model=64, num_heads=4, num_kv_heads=2, d_ff=192,
                   num_layers=2, norm="rmsnorm", position="rope", max_len=256),
        train=dict(batch_size=8, seq_len=128, steps=steps, warmup_steps=20, log_every=100,
                   sample_tokens=0, progress=False, eval_at_end=False),
        data=dict(source="text", paths=tuple(train_paths), val_paths=tuple(val_paths)),
        checkpoint=dict(enabled=True, every_steps=0, async_save=False)))
    Trainer(cfg, workdir, devices=jax.devices("cpu")[:1], log=lambda s: None).train()
    model, cfg, tok, _ = load_run(workdir)
    return model, cfg, tok


def nll(model, rows: np.ndarray) -> float:
    """Mean next-token negative log-likelihood (nats) over `rows` `[R, T + 1]`."""
    logits = model(jnp.asarray(rows[:, :-1])).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return float(-jnp.mean(jnp.take_along_axis(lp, jnp.asarray(rows[:, 1:, None]), -1)))


def ppl_table(exp, steps: int, max_rows: int):
    files = sorted(glob.glob(os.path.join(CORPUS, "*.md")))
    train, val = files[:-4], files[-4:]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        float_model, cfg, tok = trained_tiny(tmp, steps, train, val)
        print(f"trained {steps} steps in {time.time() - start:.0f} s", flush=True)
        ids = np.concatenate([tok.encode(open(f).read()) for f in val]).astype(np.int32)
        T = 128
        rows = ids[: (len(ids) // (T + 1)) * (T + 1)].reshape(-1, T + 1)[:max_rows]
        prompts = jnp.asarray(rows[:16, :64])
        base = nll(float_model, rows)
        ref = np.asarray(generate(float_model, prompts, max_new_tokens=32))
        table = []
        for label, weights, group, kv in (("float", "none", None, "none"),
                                          ("int8 weights", "int8", None, "none"),
                                          ("int8 weights (g32)", "int8", 32, "none"),
                                          ("int4 weights (g32)", "int4", 32, "none"),
                                          ("int4 weights (per channel)", "int4", None, "none"),
                                          ("int8 KV cache", "none", None, "int8"),
                                          ("int8 weights + int8 KV", "int8", None, "int8")):
            model, _, _ = (float_model, None, None) if label == "float" else (
                load_run(tmp)[0], None, None)
            model = quantize_for_serving(model, weights=weights, group=group, kv=kv,
                                         device=jax.devices("cpu")[0])
            loss = nll(model, rows)
            got = np.asarray(generate(model, prompts, max_new_tokens=32))
            table.append([label, weight_bytes(model), loss, float(np.exp(loss)),
                          float(np.exp(loss) / np.exp(base)), float(np.mean(got == ref))])
            print(table[-1], flush=True)
    exp.table(["model", "parameter bytes", "val nll (nats/byte)", "perplexity",
               "/ float", "greedy agreement (16 x 32 tokens)"], table,
              title=f"a byte-level 2-layer d=64 decoder trained {steps} steps on docs/*.md "
                    f"(validation: the last 4 files, {rows.shape[0]} x {T} tokens), this CPU")


DEFAULT_PRESET = os.path.join(HERE, "..", "configs", "default.py")
# serving variants of the quality part: (label, --quantize, --quantize_group)
WEIGHTS = (("int8 per channel", "int8", None), ("int8 g32", "int8", 32),
           ("int8 g128", "int8", 128), ("int4 per channel", "int4", None),
           ("int4 g32", "int4", 32), ("int4 g64", "int4", 64), ("int4 g128", "int4", 128))


def train_default(workdir: str, quant: str, variant: str = "") -> dict:
    """`python -m tfjax.train --config configs/default.py[:variant] --workdir
    <workdir>/<quant> --config.model.quant=<quant>` unless that run has finished; the
    final eval's metrics."""
    run = os.path.join(workdir, quant)
    metrics = os.path.join(run, "metrics.jsonl")
    final = _final_eval(metrics)
    if final is None:
        preset = DEFAULT_PRESET + (f":{variant}" if variant else "")
        cmd = [sys.executable, "-m", "tfjax.train", "--config", preset, "--workdir", run,
               f"--config.model.quant={quant}"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        final = _final_eval(metrics)
    return final


def _final_eval(metrics: str) -> dict | None:
    """The last record of a run's metrics.jsonl that holds val_loss (the end's eval)."""
    if not os.path.exists(metrics):
        return None
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    rows = [r for r in rows if "val_loss" in r]
    return rows[-1] if rows else None


def val_sums(model, cfg, tok) -> tuple[float, float]:
    """(val loss in nats per token, bits per byte) of `model` over the run's whole
    validation split, batched as the trainer's end-of-run eval batches it."""
    obj = OBJECTIVES.get(cfg.train.objective)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, b: obj.forward(nnx.merge(graphdef, s), b, 0))
    sums = dict(nll=0.0, tokens=0.0, bytes=0.0)
    for batch in obj.batches(cfg, tok, obj.source(cfg, "validation"), None, False):
        out = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        for k in sums:
            sums[k] += float(out[k])
    m = eval_metrics(obj, sums)
    return m["val_loss"], m["val_bpb"]


def held_out_prompts(cfg, tok, n: int, length: int) -> np.ndarray:
    """`n` prompts of `length` tokens: the first rows of the validation split."""
    obj = OBJECTIVES.get(cfg.train.objective)
    batch = next(iter(obj.batches(cfg, tok, obj.source(cfg, "validation"), None, False)))
    return np.asarray(batch["inputs"][:n, :length])


def train_losses(workdir: str, every: int) -> dict[int, float]:
    """{step: training loss} of a run's metrics.jsonl, every `every` steps."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
            if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and r["step"] % every == 0}


def quality_table(exp, workdir: str, prompts: int, new_tokens: int, variant: str = "",
                  step: int | None = None):
    """Item 1 of issue 50's leftovers: the default preset trained in float and with
    model.quant=int8 (same seed, same data): the final eval's val loss, or with `step`
    both runs' checkpoint `step` scored here on the whole validation split (runs
    trained, or still training, elsewhere); then the float run's checkpoint served with
    int8 / int4 weights (per channel, per group)."""
    runs = {q: os.path.join(workdir, q) for q in ("none", "int8")}
    if step is None:
        ends = {q: train_default(workdir, q, variant) for q in runs}
        table = [[f"model.quant={q}", r["step"], r["val_loss"], r["val_bpb"],
                  r["val_loss"] / ends["none"]["val_loss"]] for q, r in ends.items()]
    else:
        scored = {}
        for q, run in runs.items():
            model, cfg, tok, _ = load_run(run, step)
            scored[q] = val_sums(model, cfg, tok)
        table = [[f"model.quant={q}", step, loss, bpb, loss / scored["none"][0]]
                 for q, (loss, bpb) in scored.items()]
    exp.table(["run", "step", "val loss (nats/byte)", "val bits/byte", "/ float"], table,
              title=f"configs/default.py{':' + variant if variant else ''} trained twice "
                    f"(seed 0, the same batches): validation loss, the whole split")
    curves = {q: train_losses(run, 100) for q, run in runs.items()}
    steps = sorted(set(curves["none"]) & set(curves["int8"]))
    exp.table(["step", "train loss float", "train loss int8", "int8 / float"],
              [[s, curves["none"][s], curves["int8"][s], curves["int8"][s] / curves["none"][s]]
               for s in steps],
              title="the two runs' training loss (one batch, as logged) at the same steps")
    model, cfg, tok, at = load_run(runs["none"], step)
    base, base_bpb = val_sums(model, cfg, tok)
    x = jnp.asarray(held_out_prompts(cfg, tok, prompts, 64))
    ref = np.asarray(generate(model, x, max_new_tokens=new_tokens))  # the new tokens
    rows = [["float32", weight_bytes(model), base, base_bpb, 1.0, 1.0]]
    for label, weights, group in WEIGHTS:
        model = quantize_for_serving(load_run(runs["none"], at)[0], weights=weights,
                                     group=group, device=jax.devices("cpu")[0])
        loss, bpb = val_sums(model, cfg, tok)
        got = np.asarray(generate(model, x, max_new_tokens=new_tokens))
        rows.append([label, weight_bytes(model), loss, bpb, loss / base,
                     float(np.mean(got == ref))])
        print(rows[-1], flush=True)
    exp.table(["weights", "parameter bytes", "val loss (nats/byte)", "val bits/byte",
               "loss / float", f"greedy agreement ({prompts} x {new_tokens} tokens)"], rows,
              title=f"the float run's checkpoint (step {at}) served with quantized weights "
                    f"(`quantize_weights`, every layer of the stack), this CPU")


def train_table(exp, variant, topologies, batch, seq):
    table = []
    for topology in topologies:
        base = None
        for quant in FORMATS:
            r = row(variant, topology, quant, batch, seq)
            base = base or r
            est = r["optimal_seconds"]
            table.append([topology, quant, est * 1e3 if est > 0 else "—",
                          est / base["optimal_seconds"] if est > 0 and base["optimal_seconds"] > 0
                          else "—", r["temp"] / GiB, r["total"] / GiB,
                          r["raw_seconds"] * 1e3, r["tflops"],
                          f"{r['eight_bit']} / {r['dots']}", r["compile_s"]])
            print(table[-1], flush=True)
    exp.table(["topology", "model.quant", "optimal ms", "/ bf16", "temp GiB", "total GiB",
               "raw optimal ms", "XLA TFLOP", "8-bit dots / dots", "compile s"], table,
              title=f"Llama-3.2-1B ({variant}) train step, batch {batch} x {seq}, fsdp 4, "
                    f"per chip, XLA:TPU (libtpu topologies on this CPU)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--topologies", default="v5e:2x2,v6e:2x2")
    parser.add_argument("--parts", default="train,decode,ppl",
                        help="train (the train step), estimate (its time, every op priced), "
                             "dots (what the cost model charges an s8 matmul), "
                             "decode (the decode step), ppl (CPU), "
                             "quality (CPU: trains configs/default.py twice, ~4 min each idle)")
    parser.add_argument("--workdir", default=os.path.join(HERE, "..", "workdirs", "quant_quality"),
                        help="quality: the two runs go to <workdir>/none and <workdir>/int8 "
                             "(reused when they have finished)")
    parser.add_argument("--quality_step", type=int, default=None,
                        help="quality: score both runs' checkpoint of this step instead of "
                             "training them to the end")
    exp = Experiment("quant", __doc__, parser=parser, argv=argv)
    a = exp.args
    parts = a.parts.split(",")
    variant = "tiny" if exp.quick else "1b"
    topologies = ["v5e:2x2"] if exp.quick else a.topologies.split(",")
    if "train" in parts:
        train_table(exp, variant, topologies, *((8, 256) if exp.quick else (8, 2048)))
    if "dots" in parts:
        dots_table(exp, topologies)
    if "estimate" in parts:
        estimate_table(exp, variant, topologies, *((8, 256) if exp.quick else (8, 2048)))
    if "decode" in parts:
        decode_table(exp, variant, topologies, *((4, 256) if exp.quick else (8, 4096)))
    if "ppl" in parts:
        ppl_table(exp, *((20, 8) if exp.quick else (600, 64)))
    if "quality" in parts:
        quality_table(exp, a.workdir, *((4, 8, "quick") if exp.quick else (32, 64, "")),
                      step=a.quality_step)
    exp.finish()


if __name__ == "__main__":
    main()
