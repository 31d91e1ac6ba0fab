"""Reading and writing safetensors files with numpy alone (no torch, no flax framework).

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian
header length, a JSON header `{name: {dtype, shape, data_offsets}}` and the raw
little-endian tensor bytes. We parse it ourselves and memory-map the data, so
bfloat16 / float8 tensors come out as `ml_dtypes` numpy arrays (as jax uses) and
nothing is read before it is asked for. Sharded checkpoints
(`model.safetensors.index.json`, `{"weight_map": {name: file}}`) read the same.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsCheckpoint", "save_file", "write_file"]

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _read_header(path: str) -> tuple[dict, int]:
    """(`{name: {dtype, shape, data_offsets}}`, byte where the data starts) of one file,
    checked against the file: a header length past the end of the file, a header that
    is not a JSON object of that layout, or a tensor whose bytes run past the end (a
    truncated download) is a ValueError naming the file (and the tensor)."""
    size = os.path.getsize(path)
    redo = "re-download it, or re-save it with save_pretrained"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than its "
                             f"8-byte header length); {redo}")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file, or truncated: its first 8 bytes "
                             f"give a header of {n:,} bytes but the file has {size:,}; {redo}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"{path}: not a safetensors file: its header is not JSON ({e}); "
                             f"{redo}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file: its header is not a JSON object; {redo}")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
              and isinstance(info.get("shape"), list)
              and all(type(d) is int and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(type(o) is int for o in info["data_offsets"])
              and 0 <= info["data_offsets"][0] <= info["data_offsets"][1])
        if not ok:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry "
                             f"{repr(info)[:200]} (want {{dtype, shape, data_offsets: [begin, "
                             f"end]}}); the file is damaged: {redo}")
        lo, hi = info["data_offsets"]
        if start + hi > size:
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte {start + hi:,} but "
                             f"the file has {size:,} bytes; {redo}")
        dtype = _DTYPES.get(info["dtype"])
        if dtype is not None and hi - lo != math.prod(info["shape"]) * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}) has "
                             f"{hi - lo:,} data bytes, not the "
                             f"{math.prod(info['shape']) * np.dtype(dtype).itemsize:,} its shape "
                             f"needs; the file is damaged: {redo}")
    return header, start


class SafetensorsCheckpoint(Mapping):
    """`{name: np.ndarray}` over the `*.safetensors` files of a directory (lazy, read-only).

    With `model.safetensors.index.json` the files are those its weight map names;
    otherwise every `*.safetensors` file in the directory. Every file's header is
    checked when the checkpoint is opened (`_read_header`), so a damaged or truncated
    file is a ValueError naming it before any tensor is read.
    """

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index}: not a safetensors index (want JSON "
                                 '{"weight_map": {tensor: file}}; ' f"{type(e).__name__}: {e}); "
                                 "re-save the checkpoint with save_pretrained") from None
            for name in files:
                if not isinstance(name, str) or not os.path.isfile(os.path.join(directory, name)):
                    raise ValueError(f"{index}: its weight_map names {name!r}, which is not a file "
                                     f"in {directory}; download the missing shard")
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors files (torch .bin checkpoints are not "
                             "read; convert them with transformers' save_pretrained)")
        self._where: dict[str, tuple[str, dict, int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            header, start = _read_header(path)
            for key, info in header.items():
                self._where[key] = (path, info, start)
        self._maps: dict[str, np.memmap] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        path, info, start = self._where[key]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has safetensors dtype {info['dtype']}, "
                             f"which tfjax does not read (supported: {', '.join(_DTYPES)})")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        lo, hi = info["data_offsets"]
        buf = self._maps[path][start + lo:start + hi]
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def dtype(self, key: str) -> np.dtype:
        return np.dtype(_DTYPES[self._where[key][1]["dtype"]])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def save_file(tensors: Mapping[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """Write `{name: array}` as one safetensors file (the layout transformers reads)."""
    arrays = {name: np.ascontiguousarray(np.asarray(tensors[name])) for name in sorted(tensors)}
    write_file({n: (a.shape, a.dtype) for n, a in arrays.items()}, arrays.__getitem__, path,
               metadata)


def write_file(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
               tensor: Callable[[str], np.ndarray], path: str,
               metadata: dict | None = None) -> None:
    """Write one safetensors file tensor by tensor: `specs` gives each name's shape and
    dtype (the header) in the order the data is laid out, `tensor(name)` its array,
    asked for in that order, so one tensor at a time need be in memory."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (shape, dtype) in specs.items():
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in specs.items():
            a = np.ascontiguousarray(tensor(name))
            if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                raise ValueError(f"{name}: got {a.dtype}{list(a.shape)}, the header says "
                                 f"{np.dtype(dtype)}{list(shape)}")
            f.write(a.tobytes())
