"""A tiny random transformers Llama saved with a byte-level BPE tokenizer (trained on
ASCII, so every other character is several byte tokens) and a chat template: what the
server tests serve with `--hf`-style loading.

Its weights are random but for one cycle: after each token of `WRITES` greedy decoding
writes the next one (dimensions of the residual stream that only those tokens' embeddings
write and only the output head reads), so a prompt ending in "!" is answered
"Zürich→東京!Zürich→..." with every non-ASCII character split across byte tokens."""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tfjax.inference.engine import EngineConfig

SPECIAL = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["hello world, how are you today? the quick brown fox jumps over the lazy dog. "
          "a stitch in time saves nine; all that glitters is not gold!"] * 8


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A",
                                                       special_tokens=[("<|bos|>", 0)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
        chat_template=TEMPLATE, clean_up_tokenization_spaces=False)


WRITES = "Zürich→東京!"
NAME = "tiny-llama"  # the served model's name
CONFIG = EngineConfig(max_seqs=4, max_len=128, page_size=8, chunk=16)  # the server's engine
HIDDEN, CODE = 48, 16  # the last CODE dims of the residual stream carry the cycle only


def cycle(tok) -> list[int]:
    """The token ids of `WRITES`, each once (so each has one successor)."""
    ids = tok.encode(WRITES, add_special_tokens=False)
    assert len(set(ids)) == len(ids) <= CODE and tok.decode(ids) == WRITES, ids
    return ids


def save(path, *, max_positions: int = 256):
    """Write the checkpoint to `path`; return (the transformers model, its tokenizer)."""
    tok = tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
        tie_word_embeddings=False, max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    code = slice(HIDDEN - CODE, HIDDEN)
    ids = cycle(tok)
    with torch.no_grad():  # the code dims: written by the cycle's embeddings, read by the head
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, code] = 0.0
        head[:, code] = 0.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[code] = 0.0
            layer.mlp.down_proj.weight[code] = 0.0
        for i, (t, successor) in enumerate(zip(ids, ids[1:] + ids[:1])):
            embed[t, HIDDEN - CODE + i] = 100.0
            head[successor, HIDDEN - CODE + i] = 4.0
    model.generation_config.pad_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def greedy(model, tok, ids: list[int], n: int) -> list[int]:
    """transformers' greedy answer to token ids `ids`: at most `n` tokens, up to and with
    an EOS."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()
