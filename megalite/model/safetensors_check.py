"""A safetensors file checked from its header alone, before launch: the 8-byte header length,
the JSON header, and every tensor's byte range against its dtype, shape and the file's size
(the format: https://github.com/huggingface/safetensors, "Format"). A damaged file (a bad
header, a truncated shard, a shard the index names but the directory lacks) is a ConfigError
of one line naming the file and what is wrong, instead of a traceback after the process group
exists. No tensor data is read.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import List

from megalite.config.errors import ConfigError

INDEX = "model.safetensors.index.json"
# bytes per element of the dtypes the format defines
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def weight_files(directory: Path) -> List[Path]:
    """The safetensors files of a `transformers` directory: the shards its index names, or its
    *.safetensors files."""
    index = directory / INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); "
                          "write the directory again (save_pretrained)") from e
    return [directory / s for s in shards]


def header_problem(path: Path) -> str:
    """What is wrong with the safetensors file `path` ("" if nothing)."""
    if not path.is_file():
        return "missing (the index names it)"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            return f"a header of {n} bytes announced in a file of {size} bytes (not safetensors)"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # UnicodeDecodeError is a ValueError
            return f"its header is not JSON ({e})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_problem(name, info, data)
        if problem:
            return problem
    return ""


def _tensor_problem(name: str, info, data: int) -> str:
    try:
        begin, end = info["data_offsets"]
        need = math.prod(info["shape"]) * ITEMSIZE[info["dtype"]]
    except (KeyError, TypeError, ValueError):
        return f"tensor {name!r} has a malformed header entry {info!r}"
    if end - begin != need:
        return (f"tensor {name!r} ({info['dtype']} {info['shape']}) spans {end - begin} bytes, "
                f"not {need}")
    if end > data:
        return (f"truncated: tensor {name!r} ends at byte {end} of the data, which holds "
                f"{data} bytes")
    return ""


def check_weight_files(directory: Path, key: str) -> None:
    """Every safetensors file of `directory` whole (headers read only); ConfigError naming the
    first damaged one (`key`: the configuration key that named the directory)."""
    for path in weight_files(directory):
        problem = header_problem(path)
        if problem:
            raise ConfigError(f"{key}: {path} is damaged: {problem}; download or write it "
                              "again (save_pretrained, hf download)")
