"""lm-eval tasks scored by tfjax models, with lm_eval (the optional `eval` extra)
imported on first use: the requests of lm-eval's `tfjax` model (`TfjaxRequests`,
made an lm-eval model and registered by `lm_eval_model()`), `task_manager`, and the
training hook of `train.eval_tasks` (`training_evaluator`). `tfjax.eval.harness`
is the model's home for users (importing it registers the model) and its command
line; docs/evaluation.md."""

from __future__ import annotations

import functools
import os
import types

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tfjax.config import MeshConfig
from tfjax.eval.loading import Source, check_context, eval_mesh, load_source, run_source
from tfjax.eval.perplexity import Scorer
from tfjax.inference.engine import Engine, EngineConfig, Request
from tfjax.parallel.rules import logical_rules, tree_shardings

__all__ = ["TfjaxRequests", "lm_eval_model", "task_manager", "training_evaluator"]


class TfjaxRequests:
    """What lm-eval's `tfjax` model does (`lm_eval_model()` makes it lm-eval's
    `TemplateLM`; tfjax.eval.harness's docstring for the arguments)."""

    def __init__(self, path: str | None = None, *, hf: str | None = None,
                 workdir: str | None = None, step: int | None = None, batch_size=8,
                 max_length: int | None = None, max_gen_toks: int = 256, mesh: str | None = None,
                 add_bos_token: bool | None = None, device: str | None = None,
                 max_batch_size: int | None = None, source: Source | None = None):
        # device / max_batch_size: lm-eval passes them to every model; the mesh decides
        # where tfjax runs and batch_size how much at once. `source`: a model already in
        # memory (`training_evaluator`), used instead of path / hf / workdir; `mesh` may
        # then be the jax Mesh its parameters live on.
        super().__init__()
        if source is not None:
            if path is not None or hf is not None or workdir is not None:
                raise ValueError("TfjaxLM: give source= or a path, not both")
        elif path is not None:
            if hf is not None or workdir is not None:
                raise ValueError("model_args: give path= or one of hf= / workdir=, not both")
            if not os.path.isdir(path):
                raise ValueError(f"model_args path={path}: not a directory; give a Hugging "
                                 f"Face checkpoint or a tfjax training run directory")
            if os.path.isdir(os.path.join(path, "checkpoints")):
                workdir = path
            else:
                hf = path
        self.src = source if source is not None else load_source(hf=hf, workdir=workdir,
                                                                  step=step)
        if not self.src.eos_ids:
            raise ValueError(f"model_args: {self.src.description} has no eos_token_id (its "
                             f"config.json); lm-eval needs one to end generations and to "
                             f"condition empty contexts")
        self._max_length = check_context(self.src, int(max_length or self.src.context),
                                         "model_args max_length")
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        if isinstance(mesh, Mesh):
            self.mesh, mesh_cfg = mesh, MeshConfig(rules=self.src.rules)
        else:
            self.mesh, mesh_cfg = eval_mesh(mesh.replace(";", ",") if mesh else None,
                                            self.src.rules)
        self.rules = logical_rules(mesh_cfg.rules)
        model = self.src.model
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, tree_shardings(state, self.mesh, self.rules)))
        self.model = model
        self.scorer = Scorer(model, mesh=self.mesh, rules=mesh_cfg.rules,
                             batch_size=int(batch_size))
        self._engine = None

    @property
    def engine(self) -> Engine:
        """The inference engine both request kinds run on (made on first use): batch_size
        sequences at once, prompts up to max_length + 1 tokens (a scored one)."""
        if self._engine is None:
            self._engine = Engine(self.model, EngineConfig(
                max_seqs=self.scorer.batch_size, max_len=self.max_length + 1, page_size=16,
                chunk=min(64, self.max_length)), eos_ids=(self.eot_token_id,),
                decode=self.tok_decode, mesh=self.mesh, rules=self.rules)
        return self._engine

    def _run(self, requests: list[Request], bar) -> dict:
        """Run `requests` on the engine: {request_id: (tokens, the first output)}."""
        engine, out = self.engine, {}
        for r in requests:
            engine.submit(r)
            out[r.request_id] = ([], None)
        while engine.has_work():
            for o in engine.step():
                tokens, first = out[o.request_id]
                if o.token is not None:
                    tokens.append(o.token)
                out[o.request_id] = (tokens, first or o)
                if o.finish_reason is not None:
                    bar.update(1)
        return out

    # --------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.src.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self.src.bos_id if self.src.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        specials = add_special_tokens
        if specials is None:
            specials = True if self.add_bos_token is None else self.add_bos_token
        ids = list(self.src.encode(string, specials))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.src.decode(list(tokens))

    # --------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """[(key, context ids, continuation ids)] -> [(log p(continuation), greedy)], on
        the engine: each whole sequence a scored prompt (contexts shared by several
        continuations computed once, their pages shared)."""
        from tqdm import tqdm

        scored = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            scored.append(Request(whole, max_tokens=0,
                                  score_from=max(1, len(whole) - len(cont))))
        with tqdm(total=len(scored), disable=disable_tqdm, desc="tfjax loglikelihood") as bar:
            results = self._run(scored, bar)
        out: list[tuple[float, bool]] = []
        for req, r in zip(requests, scored):
            first = results[r.request_id][1]
            answer = (float(np.sum(np.asarray(first.prompt_logprobs, np.float64))),
                      bool(all(first.prompt_greedy)))
            out.append(answer)
            if req[0] is not None:
                self.cache_hook.add_partial("loglikelihood", req[0], answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils as lm_utils

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                          postprocess_generated_text)
        from tqdm import tqdm

        """Each request a `Request` of the engine, all of them batched continuously."""
        jobs, untils = [], []
        for req in requests:
            kw = normalize_gen_kwargs(dict(req.args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=None)
            n_new = int(kw.pop("max_gen_toks"))
            max_ctx = self.max_length - n_new
            if max_ctx < 1:
                raise ValueError(f"generate_until: max_gen_toks={n_new} leaves no room for a "
                                 f"prompt in max_length={self.max_length}")
            sample = bool(kw.get("do_sample")) and float(kw.get("temperature") or 0.0) > 0
            settings = dict(temperature=float(kw.get("temperature") or 0.0) if sample else 0.0,
                            top_k=kw.get("top_k") if sample else None,
                            top_p=kw.get("top_p") if sample else None,
                            seed=int(kw.get("seed", 0) or 0))
            prompt = self.tok_encode(req.args[0], left_truncate_len=max_ctx) or \
                [self.prefix_token_id]
            jobs.append(Request(prompt, max_tokens=n_new, sampling=settings, stop=until))
            untils.append(until)
        with tqdm(total=len(jobs), disable=disable_tqdm, desc="tfjax generate_until") as bar:
            results = self._run(jobs, bar)
        out = []
        for req, job, until in zip(requests, jobs, untils):
            toks = [t for t in results[job.request_id][0] if t != self.eot_token_id]
            text = postprocess_generated_text(self.tok_decode(toks), until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


@functools.cache
def lm_eval_model() -> type:
    """`TfjaxLM`: `TfjaxRequests` as an lm-eval `TemplateLM`, registered as lm-eval's
    `tfjax` model; made once, on first use (it imports lm_eval)."""
    # lm-eval's own models first: it loads them only into a registry that is still empty.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    def body(ns):
        ns.update(__module__=__name__, __doc__="lm-eval's `tfjax` model (tfjax.eval.harness's "
                  "docstring for the arguments).")

    model = types.new_class("TfjaxLM", (TfjaxRequests, TemplateLM), exec_body=body)
    register_model("tfjax")(model)
    return model


def task_manager(names: list[str], include_path: str = "", field: str = "train.eval_tasks"):
    """An lm-eval TaskManager that knows every task of `names` (the tasks in
    `include_path` alone when they are all there, which skips indexing lm-eval's
    hundreds of built-in tasks; else those too); an unknown name is a ValueError
    naming `field`."""
    from lm_eval.tasks import TaskManager

    if include_path and not os.path.isdir(include_path):
        raise ValueError(f"{field}_path: {include_path} is not a directory of lm-eval task "
                         f"YAMLs")
    manager = TaskManager(include_path=include_path or None, include_defaults=False) \
        if include_path else None
    if manager is None or any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=include_path or None)
    missing = [n for n in names if n not in manager.all_tasks]
    if missing:
        raise ValueError(f"{field}: unknown lm-eval task(s) {', '.join(missing)}; name "
                         f"built-in tasks (e.g. hellaswag, arc_easy) or tasks of the YAMLs "
                         f"in {field}_path")
    return manager


def training_evaluator(tasks: str, *, include_path: str = "", limit: int = 0,
                       batch_size: int = 8):
    """`train.eval_tasks` for `Trainer(eval_hooks=[...])`: a hook that scores the
    model being trained on lm-eval tasks at every evaluation (`Trainer.evaluate`) and
    returns each task's metrics as `lm_eval/<task>/<metric>` (lm-eval's filter
    suffix ",none" dropped; standard errors left out). The model is the trainer's
    state on the trainer's mesh; its text goes through the run's tokenizer as the
    training documents do (`[bos] + encode(text)`), its context is `train.seq_len`.
    Task names are checked here, before anything compiles."""
    import lm_eval

    model = lm_eval_model()
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    manager = task_manager(names, include_path)

    def hook(trainer, state) -> dict[str, float]:
        src = run_source(trainer.model(state), trainer.cfg, trainer.tokenizer,
                         description=f"{trainer.workdir} (training)")
        lm = model(source=src, mesh=trainer.mesh, batch_size=batch_size)
        out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager,
                                      limit=limit or None, log_samples=False,
                                      verbosity="ERROR")
        metrics = {}
        for task, values in out["results"].items():
            for key, value in values.items():
                name, _, _ = key.partition(",")
                if isinstance(value, (int, float)) and not name.endswith("_stderr"):
                    metrics[f"lm_eval/{task}/{name}"] = float(value)
        return metrics

    return hook
