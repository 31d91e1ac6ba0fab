"""What the evaluation tests score: a random tiny Hugging Face Llama with a byte-level
tokenizer (tfjax's `ByteTokenizer` as tokenizer.json), saved as `save_pretrained`
writes it (scored with tfjax and with transformers / lm-eval's `hf` backend), and a
tfjax training run directory."""

from __future__ import annotations

import json

CONTEXT = 32  # max_position_embeddings: the tests' texts are longer, to make windows


def save_tiny_llama(path: str):
    """Write the checkpoint and its tokenizer to `path`; return the transformers model."""
    import torch
    import transformers

    from tfjax.data import ByteTokenizer

    tok = ByteTokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    hf_tok = tok.hf_tokenizer()
    name = hf_tok.id_to_token
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf_tok, bos_token=name(tok.bos_id), eos_token=name(tok.eos_id),
        pad_token=name(tok.pad_id), model_max_length=CONTEXT).save_pretrained(path)
    return model


def make_run(tmp_path) -> str:
    """A run directory as `python -m tfjax.train` leaves it (the trainer's initial state,
    saved at step 3 by its own Checkpointer, and its config.json)."""
    import jax

    from tfjax import config as C
    from tfjax.train.trainer import Trainer, _plain

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    cfg = C.from_dict(C.RunConfig, dict(
        model=dict(vocab_size=259, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                   num_layers=2, norm="rmsnorm", position="rope", init_std=0.5),
        train=dict(steps=3, batch_size=2, seq_len=32, warmup_steps=1, log_every=1,
                   eval_at_end=False, sample_tokens=0, progress=False),
        data=dict(source="text", paths=(str(corpus),), val_paths=(str(corpus),)),
        checkpoint=dict(enabled=True, every_steps=0, async_save=False)))
    wd = str(tmp_path / "w")
    tr = Trainer(cfg, wd, devices=jax.devices()[:1], log=lambda s: None)
    tr.checkpointer.save(3, tr.init_state(), tr.train_iterator().get_state(), wait=True)
    tr.checkpointer.close()
    with open(f"{wd}/config.json", "w") as f:
        json.dump(_plain(cfg), f, indent=1)
    return wd
