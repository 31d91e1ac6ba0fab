"""`python -m tfjax.generate --hf PATH --chat`: a tiny random HF model saved with a
real `tokenizers` BPE tokenizer and a chat template prints exactly the reply of HF
`generate` (greedy, 20 tokens) on transformers' own `apply_chat_template` of the
prompt, stopping at generation_config.json's EOS list as HF does."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not "
                                   "installed")
tokenizers = pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")

from tfjax.generate import chat_prompt, main  # noqa: E402

SPECIAL = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>"]
# Block tags on lines of their own: rendered as transformers does (trim_blocks,
# lstrip_blocks), the text is "<|bos|><|user|>how are you, quick fox?<|end|>\n<|assistant|>".
TEMPLATE = ("{{ bos_token }}{% for m in messages %}\n"
            "<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>\n"
            "  {% endfor %}\n"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "  how are you, quick fox?"
N = 20


def _tokenizer():
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["hello world, how are you today? the quick brown fox jumps over the lazy dog"] * 8,
        trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A",
                                                       special_tokens=[("<|bos|>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                                eos_token="<|eos|>", chat_template=TEMPLATE)


MODELS = {  # family -> (HF config, model class)
    "llama": (lambda V: transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
        tie_word_embeddings=False), "LlamaForCausalLM"),
    "gpt2": (lambda V: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                               n_positions=64, initializer_range=0.1),
             "GPT2LMHeadModel"),
}


def _cli(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


@pytest.mark.parametrize("family", list(MODELS))
def test_chat_reply_is_hf_generate_on_the_templated_prompt(family, tmp_path):
    tok = _tokenizer()
    make, cls = MODELS[family]
    torch.manual_seed(0)
    ref = getattr(transformers, cls)(make(len(tok))).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, return_tensors="pt")["input_ids"]
    T, mask = ids.shape[1], torch.ones_like(ids)  # (a pad id would mask the BOS, id 0)
    with torch.no_grad():
        free = ref.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                            eos_token_id=None, pad_token_id=len(tok) - 1)[0, T:].tolist()
    # An end-of-turn id HF meets mid-reply (and one it never meets): the CLI must stop there.
    stop = next(t for k, t in enumerate(free) if k >= 3 and t not in free[:k])
    unused = next(t for t in range(len(tok)) if t not in free)
    ref.generation_config.eos_token_id = [unused, stop]
    ref.generation_config.pad_token_id = len(tok) - 1
    ref.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    if family == "llama":  # the older layout: the template inside tokenizer_config.json
        os.remove(tmp_path / "chat_template.jinja")
        with open(tmp_path / "tokenizer_config.json") as f:
            tok_cfg = json.load(f)
        with open(tmp_path / "tokenizer_config.json", "w") as f:
            json.dump(dict(tok_cfg, chat_template=TEMPLATE), f)
    assert chat_prompt(str(tmp_path), PROMPT) == tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)

    with torch.no_grad():
        gen = ref.generate(ids, attention_mask=mask, max_new_tokens=N,
                           do_sample=False)[0, T:].tolist()
    assert gen[-1] == stop and len(gen) < N  # HF stopped at the EOS list's second id
    rc, out = _cli(["--hf", str(tmp_path), "--chat", "--prompt", PROMPT,
                    "--max_new_tokens", str(N)])
    assert rc == 0
    assert out == tok.decode(gen[:-1], skip_special_tokens=True) + "\n"  # the EOS not shown
    assert out.strip() and PROMPT.strip() not in out  # the reply only


def test_chat_without_a_template_is_a_one_line_error(tmp_path, capsys):
    tok = _tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / "chat_template.jinja")
    rc, _ = _cli(["--hf", str(tmp_path), "--chat", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer_config.json" in err and err.count("\n") == 1, err
    rc, _ = _cli(["--workdir", str(tmp_path), "--chat", "--prompt", "hi"])
    assert rc == 2 and "--chat is for --hf" in capsys.readouterr().err


def test_chat_without_jinja2_names_the_extra(tmp_path, monkeypatch):
    _tokenizer().save_pretrained(tmp_path)
    for name in ("jinja2", "jinja2.ext", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)  # import jinja2 -> ImportError
    with pytest.raises(ValueError, match=r"needs jinja2; install the hf extra"):
        chat_prompt(str(tmp_path), "hi")
