"""Damaged Hugging Face checkpoint files are one-line ValueErrors naming the file (and
the tensor / key) and the fix: never a MemoryError, a KeyError or a silent wrong
model. Nothing here builds a model."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest

from tfjax.interop import hf
from tfjax.interop.safetensors_io import SafetensorsCheckpoint, save_file

pytestmark = pytest.mark.bad_input

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4)


def _raw(header, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h)) + h + data


def _valid(tmp_path) -> bytes:
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.ones(4, np.int64)}, str(tmp_path / "ok.safetensors"))
    return (tmp_path / "ok.safetensors").read_bytes()


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
# (valid file's bytes -> the bad file's bytes, regex after "{path}: ")
SAFETENSORS = {
    "random_bytes": (lambda ok: np.random.default_rng(0).bytes(4096),
                     r"not a safetensors file, or truncated: its first 8 bytes give a header of "
                     r"[\d,]+ bytes but the file has 4,096"),
    "shorter_than_8": (lambda ok: b"\x01\x02", r"not a safetensors file \(2 bytes, shorter"),
    "empty": (lambda ok: b"", r"not a safetensors file \(0 bytes"),
    "header_not_json": (lambda ok: _raw(b"{not json at all}"),
                        r"not a safetensors file: its header is not JSON"),
    "header_not_utf8": (lambda ok: _raw(b'{"\xff": 1}'),
                        r"not a safetensors file: its header is not JSON"),
    "header_a_list": (lambda ok: _raw([1, 2]),
                      r"not a safetensors file: its header is not a JSON object"),
    "entry_without_offsets": (lambda ok: _raw({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
                              r"tensor 'w' has a malformed header entry"),
    "negative_shape": (lambda ok: _raw({"w": dict(F32x2, shape=[-2])}, b"\0" * 8),
                       r"tensor 'w' has a malformed header entry"),
    "offsets_reversed": (lambda ok: _raw({"w": dict(F32x2, data_offsets=[8, 0])}, b"\0" * 8),
                         r"tensor 'w' has a malformed header entry"),
    "size_not_shape": (lambda ok: _raw({"w": dict(F32x2, shape=[3])}, b"\0" * 8),
                       r"tensor 'w' \(F32 \[3\]\) has 8 data bytes, not the 12 its shape needs"),
    "truncated": (lambda ok: ok[:-5], r"truncated: tensor 'b' ends at byte [\d,]+ but the file "
                  r"has [\d,]+ bytes; re-download it"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS))
def test_bad_safetensors_file_names_file_and_tensor(tmp_path, case):
    make, message = SAFETENSORS[case]
    ok = _valid(tmp_path)
    os.remove(tmp_path / "ok.safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(make(ok))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}") as e:
        SafetensorsCheckpoint(str(tmp_path))
    assert "\n" not in str(e.value)


def test_bad_safetensors_through_load(tmp_path):
    """hf.load reads the headers before building anything: a truncated file fails there."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    ok = _valid(tmp_path)
    os.remove(tmp_path / "ok.safetensors")
    (tmp_path / "model.safetensors").write_bytes(ok[:-1])
    with pytest.raises(ValueError, match=r"model.safetensors: truncated: tensor 'b'"):
        hf.load(str(tmp_path))


def test_unsupported_dtype_names_file_and_tensor(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(
        _raw({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8))
    ck = SafetensorsCheckpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'w' has safetensors dtype "
                                         r"C64, which tfjax does not read"):
        ck["w"]


INDEXES = {
    "not_json": (b"{", r"not a safetensors index"),
    "no_weight_map": (json.dumps({"metadata": {}}).encode(), r"not a safetensors index .*KeyError"),
    "missing_shard": (json.dumps({"weight_map": {"a": "model-00002.safetensors"}}).encode(),
                      r"its weight_map names 'model-00002.safetensors', which is not a file"),
}


@pytest.mark.parametrize("case", list(INDEXES))
def test_bad_index_names_the_index(tmp_path, case):
    content, message = INDEXES[case]
    _valid(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(index))}: {message}"):
        SafetensorsCheckpoint(str(tmp_path))


# (config.json content, regex after "{path}: ")
CONFIGS = {
    "not_json": (b'{"model_type": "llama",', r"not valid JSON \(.*line 1 column"),
    "not_utf8": (b'{"model_type": "\xff"}', r"not valid JSON"),
    "a_list": (b"[1, 2]", r"holds list, not the JSON object of a model config"),
    "missing_hidden_size": ({k: v for k, v in LLAMA.items() if k != "hidden_size"},
                            r"no key 'hidden_size', which model_type='llama' needs; add it"),
    "missing_gpt2_n_embd": (dict(model_type="gpt2", vocab_size=64, n_layer=2, n_head=4,
                                 n_positions=32), r"no key 'n_embd', which model_type='gpt2'"),
    "string_size": (dict(LLAMA, hidden_size="32"),
                    r'hidden_size is "32" \(a string\), but it must be an integer; fix '
                    r"hidden_size in .*config.json"),
    "bool_size": (dict(LLAMA, num_hidden_layers=True),
                  r"num_hidden_layers is true \(true / false\), but it must be an integer"),
    "null_vocab": (dict(LLAMA, vocab_size=None), r"vocab_size is null \(null\), but it must be an "
                   r"integer"),
    "string_bool": (dict(LLAMA, tie_word_embeddings="no"),
                    r'tie_word_embeddings is "no" \(a string\), but it must be true / false'),
    "string_eps": (dict(LLAMA, rms_norm_eps="1e-6"), r"rms_norm_eps is .* must be a number"),
    "rope_factor": (dict(LLAMA, rope_scaling=dict(rope_type="linear", factor="2")),
                    r'rope_scaling.factor is "2" \(a string\), but it must be a number or null'),
    "eos_strings": (dict(LLAMA, eos_token_id=["</s>"]),
                    r"eos_token_id is .* must be an integer or a list of integers or null"),
    "model_type_number": (dict(LLAMA, model_type=7), r"model_type is 7 .* must be a string"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_json_names_file_and_key(tmp_path, case):
    content, message = CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}") as e:
        hf.load(str(tmp_path))
    assert "\n" not in str(e.value)


def test_generate_cli_prints_one_line(tmp_path, capsys):
    from tfjax.generate import main

    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, hidden_size="32")))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["--hf", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {tmp_path}/config.json: hidden_size")
