"""`python -m tfjax.generate (--workdir DIR | --hf DIR) --prompt "..." [--chat --noeos
--max_new_tokens N --temperature T --top_k K --top_p P --seed S --step STEP
--quantize int8|int4 --quantize_group 32|64|128 --kv_quant int8|fp8]`

Streams the continuation of a prompt to stdout (KV-cached decoding) from a training run
(`--workdir`, latest or `--step` checkpoint: `[bos] + encode(prompt)`, stopping at EOS)
or an HF checkpoint directory (`--hf`: its tokenizer.json and generation_config.json's
EOS ids; `--chat`: through its chat template, the reply alone). Temperature 0 is greedy;
`--quantize` / `--kv_quant`: int8 / int4 weights, an 8-bit K/V cache (docs/quantization.md).
`run`, `run_hf`, `load_hf`, `chat_prompt`, `chat_renderer` are the same from Python.
See docs/inference.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import TextIO

import numpy as np

from tfjax.inference import stream
from tfjax.interop import hf
from tfjax.nn.quant import GROUPS, WEIGHT_FORMATS, quantize_for_serving
from tfjax.train.checkpoint import load_run, read_json_object

__all__ = ["add_checkpoint_flags", "add_quant_flags", "chat_prompt", "chat_renderer", "load_hf",
           "main", "quant_kwargs", "run", "run_hf"]


def run(workdir: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.0,
        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
        step: int | None = None, stop_at_eos: bool = True, out: TextIO | None = None,
        quant: dict | None = None) -> str:
    """Stream the continuation of `prompt` to `out` (stdout); return it. `quant`:
    `quantize_for_serving`'s keywords (weights=, group=, kv=)."""
    out = sys.stdout if out is None else out
    model, cfg, tok, step = load_run(workdir, step)
    quantize_for_serving(model, **(quant or {}))
    ids = np.concatenate([[tok.bos_id], tok.encode(prompt)]).astype(np.int32)[None]
    eos = tok.eos_id if stop_at_eos else None
    print(f"[tfjax.generate: step {step} of {workdir}, {cfg.model.arch}, "
          f"{ids.shape[1]} prompt tokens]", file=sys.stderr, flush=True)
    return _emit(model, ids, tok.decode, prompt, () if eos is None else (eos,), out,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 top_p=top_p, seed=seed)


def load_hf(path: str):
    """(model, model config, `tokenizers.Tokenizer`, EOS ids) from an HF checkpoint directory."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise ValueError(f"--hf: {tok_file} not found; the checkpoint directory needs the "
                         "tokenizer.json that `tokenizers` reads (save_pretrained of a fast "
                         "tokenizer writes it)")
    import tokenizers

    model, cfg = hf.load(path, scan_layers=False)  # decode steps update caches in place
    if cfg.arch != "decoder":
        raise ValueError(f"--hf: {path} is a {cfg.arch} model; the CLI generates with causal "
                         "LMs only")
    return model, cfg, tokenizers.Tokenizer.from_file(tok_file), _eos_ids(path)


def _eos_ids(path: str) -> tuple[int, ...]:
    """The ids HF `generate` stops at: generation_config.json's `eos_token_id` (an id
    or a list: a chat model's end-of-turn tokens), else config.json's."""
    eos = None
    for name, what in (("generation_config.json", "a generation config"),
                       ("config.json", "a model config")):
        file = os.path.join(path, name)
        if os.path.exists(file):
            eos = read_json_object(file, "--hf", what).get("eos_token_id")
            if eos is not None:
                break
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(type(i) is int for i in ids):
        raise ValueError(f"--hf: {file}: eos_token_id is {json.dumps(eos)}, but it must be an "
                         "integer or a list of integers")
    return tuple(ids)


def _chat_template(path: str) -> str:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: "default")."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    cfg_file = os.path.join(path, "tokenizer_config.json")
    cfg = (read_json_object(cfg_file, "--hf", "a tokenizer config") if os.path.exists(cfg_file)
           else {})
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values())) if len(named) == 1 else None)
    if not isinstance(template, str) or not template:
        raise ValueError(f"--chat: {cfg_file} has no chat_template (and there is no "
                         f"chat_template.jinja); drop --chat, or use an instruction-tuned "
                         f"checkpoint whose tokenizer_config.json has one")
    return template


def _special_tokens(path: str) -> dict[str, str]:
    """tokenizer_config.json's special tokens by name (bos_token, eos_token, ...), as
    chat templates read them; a token saved as an AddedToken object gives its content."""
    file = os.path.join(path, "tokenizer_config.json")
    cfg = read_json_object(file, "--hf", "a tokenizer config") if os.path.exists(file) else {}
    out = {}
    for key, value in cfg.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def chat_renderer(path: str) -> Callable[[list[dict]], str]:
    """The checkpoint's chat template as a function of the messages (a list of
    {"role", "content"} dicts) to the text to encode without adding special tokens, with
    the generation prompt added. Rendered as transformers' `apply_chat_template` renders
    (a sandboxed jinja2 environment with trim_blocks, lstrip_blocks, loop controls,
    `tojson`, `raise_exception`, `strftime_now`, the tokenizer's special tokens); a
    template that does not render raises a one-line ValueError."""
    template = _chat_template(path)
    try:
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ValueError("--chat: rendering the chat template needs jinja2; install the hf "
                         "extra (pip install 'tfjax[hf]', whose transformers brings it) or "
                         "jinja2 itself") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    specials = _special_tokens(path)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"--chat: the chat template of {path} does not parse: {e}") from None

    def render(messages: list[dict]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **specials)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template of {path} does not render these messages: "
                             f"{e}") from None

    return render


def chat_prompt(path: str, prompt: str) -> str:
    """`prompt` as the one user message of the checkpoint's chat template, with the
    generation prompt added (`chat_renderer`): the text to encode without adding special
    tokens."""
    try:
        return chat_renderer(path)([{"role": "user", "content": prompt}])
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith("--chat") else f"--chat: {message}") \
            from None


def run_hf(path: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           stop_at_eos: bool = True, chat: bool = False, out: TextIO | None = None,
           quant: dict | None = None) -> str:
    """`run` for an HF checkpoint directory (`--hf DIR`); `chat`: through its chat
    template (`chat_prompt`), printing only the reply."""
    out = sys.stdout if out is None else out
    text = chat_prompt(path, prompt) if chat else prompt  # before the model loads
    model, cfg, tok, eos = load_hf(path)
    quantize_for_serving(model, **(quant or {}))
    ids = np.asarray(tok.encode(text, add_special_tokens=not chat).ids, np.int32)[None]
    if ids.shape[1] == 0:
        raise ValueError("--prompt: encodes to no tokens; give a non-empty prompt")
    print(f"[tfjax.generate: {path}, {ids.shape[1]} prompt tokens"
          f"{', chat template' if chat else ''}]", file=sys.stderr, flush=True)
    return _emit(model, ids, tok.decode, "" if chat else prompt, eos if stop_at_eos else (), out,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                 top_p=top_p, seed=seed)


def _emit(model, ids, decode, echo: str, eos: tuple, out: TextIO, **kw) -> str:
    """Write `echo`, then stream the continuation of `ids` to `out` as text; stop at any
    id in `eos`."""
    generated: list[int] = []
    shown = ""
    out.write(echo)
    for t in stream(model, ids, eos_id=eos[0] if eos else None, **kw):
        t = int(t[0])
        if t in eos:
            break
        generated.append(t)
        text = decode(generated)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its bytes
            continue
        out.write(text[len(shown):])
        out.flush()
        shown = text
    text = decode(generated)
    out.write(text[len(shown):] + "\n")
    out.flush()
    return text


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """The model to load, exactly one of `--workdir W` (a tfjax training run: `load_run`)
    and `--hf DIR` (a Hugging Face checkpoint directory: `load_hf`); the command lines
    of `tfjax.generate` and `tfjax.eval` share them."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a `python -m tfjax.train` run directory")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory "
                     "(config.json, *.safetensors, tokenizer.json)")


def add_quant_flags(parser: argparse.ArgumentParser) -> None:
    """`--quantize`, `--quantize_group`, `--kv_quant` (`quantize_for_serving`); the
    command lines of `tfjax.generate` and `tfjax.serve` share them. `quant_kwargs`
    reads them back."""
    parser.add_argument("--quantize", choices=("none",) + WEIGHT_FORMATS, default="none",
                        help="weight-only quantization of the layer stack's matmul weights")
    parser.add_argument("--quantize_group", type=int, choices=GROUPS, default=None,
                        help="inputs per scale (default: one scale per output channel)")
    parser.add_argument("--kv_quant", choices=("none", "int8", "fp8"), default="none",
                        help="an 8-bit K/V cache, one scale per token and kv head")


def quant_kwargs(args: argparse.Namespace) -> dict:
    """`quantize_for_serving`'s keywords from `add_quant_flags`' flags."""
    return dict(weights=args.quantize, group=args.quantize_group, kv=args.kv_quant)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfjax.generate",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p)
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--noeos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--chat", action="store_true", help="with --hf: the prompt as a user message "
                   "of the checkpoint's chat template; print only the reply")
    add_quant_flags(p)
    a = p.parse_args(argv)
    try:
        kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                  top_p=a.top_p, seed=a.seed, stop_at_eos=not a.noeos, quant=quant_kwargs(a))
        if a.hf:
            if a.step is not None:
                raise ValueError("--step is for --workdir runs; an HF checkpoint has one state")
            run_hf(a.hf, a.prompt, chat=a.chat, **kw)
        else:
            if a.chat:
                raise ValueError("--chat is for --hf checkpoints (a chat template comes with "
                                 "an HF tokenizer); a --workdir run has none")
            run(a.workdir, a.prompt, step=a.step, **kw)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
