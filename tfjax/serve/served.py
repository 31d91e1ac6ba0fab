"""What the server serves: a model under a name, its tokenizer, its chat template and
the engine loop that runs it (`Served`), loaded from `--hf DIR` or `--workdir W` as
`python -m tfjax.generate` and `tfjax.eval` load them (`tfjax.eval.loading.load_source`;
the chat template through `tfjax.generate.chat_renderer`). See docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tfjax.eval.loading import Source, load_source
from tfjax.generate import chat_renderer
from tfjax.inference.engine import Engine, EngineConfig
from tfjax.models import unrolled
from tfjax.nn.quant import quantize_for_serving
from tfjax.serve.loop import EngineLoop

__all__ = ["Served", "load_served", "serve_source"]


@dataclasses.dataclass
class Served:
    """name: the model id clients send. encode(text, specials): token ids, with the
    special tokens (BOS) a document begins with when `specials`; decode(ids): text
    without special tokens. chat: messages -> the text of the chat template (None:
    `no_chat` says why). loop: the engine loop (`loop.engine.max_len` is the context)."""

    name: str
    encode: Callable[[str, bool], list[int]]
    decode: Callable[[list[int]], str]
    loop: EngineLoop
    chat: Callable[[list[dict]], str] | None = None
    no_chat: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def max_len(self) -> int:
        return self.loop.engine.max_len


def serve_source(src: Source, name: str, config: EngineConfig = EngineConfig(), *,
                 max_queue: int = 128, chat=None, no_chat: str = "",
                 quant: dict | None = None) -> Served:
    """An engine over `src`'s model, its layers unrolled (`tfjax.models.unrolled`: decode
    steps update each layer's pages in place), then quantized as `quant` says
    (`tfjax.nn.quant.quantize_for_serving`'s keywords), under `name`; its EOS ids end
    answers, `src.decode` finds stop strings."""
    model = quantize_for_serving(unrolled(src.model), **(quant or {}))
    engine = Engine(model, config, eos_ids=src.eos_ids, decode=src.decode)
    return Served(name=name, encode=src.encode, decode=src.decode,
                  loop=EngineLoop(engine, max_queue), chat=chat, no_chat=no_chat)


def load_served(*, hf: str | None = None, workdir: str | None = None, step: int | None = None,
                name: str | None = None, config: EngineConfig = EngineConfig(),
                max_queue: int = 128, quant: dict | None = None) -> Served:
    """The model of `--hf DIR` or `--workdir W` (exactly one) with its engine; `name`
    defaults to the path given, as vLLM names a model."""
    chat, no_chat = None, ("this model is a tfjax training run (--workdir), which has no "
                           "chat template; use /v1/completions")
    if hf is not None:
        try:  # before the model loads: a template that does not parse is found at once
            chat = chat_renderer(hf)
        except ValueError as e:
            reason = str(e).removeprefix("--chat: ").split("; drop --chat")[0]
            no_chat = f"{reason}; use /v1/completions"
    src = load_source(hf=hf, workdir=workdir, step=step)
    return serve_source(src, name or hf or workdir, config, max_queue=max_queue, chat=chat,
                        no_chat=no_chat, quant=quant)
