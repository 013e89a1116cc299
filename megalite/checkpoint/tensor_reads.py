"""Whole global tensors of a megalite checkpoint, a few at a time: the streaming exports
(`checkpoint.hf_stream`, `checkpoint.dcp_export`) read each output's tensors as byte ranges of
the rank files (`format.Reader`), checking only the CRC blocks those ranges touch, so a
process holds what it is writing and never the whole model."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch

from megalite.checkpoint.format import Reader, verify_ranges


def tensor_shapes(ckpt: Path, meta: dict, kind: str = "param") -> Dict[str, Tuple[int, ...]]:
    """Every global tensor of `kind` and its logical shape (from the index, no data read)."""
    reader = Reader(ckpt, meta)
    return {n: tuple(reader.index.tensor(n).spec.shape) for n in reader.index.names()
            if reader.has(n, kind)}


def tensor_sizes(ckpt: Path, meta: dict) -> Dict[str, int]:
    """Elements of each global weight tensor."""
    return {n: int(np.prod(shape)) for n, shape in tensor_shapes(ckpt, meta).items()}


def read_tensors(ckpt: Path, meta: dict, names: List[str]) -> Dict[str, torch.Tensor]:
    """Whole global tensors `names` (fp32 master weights, vocabulary unpadded), reading and
    checking only the byte ranges that hold them."""
    reader = Reader(ckpt, meta)
    plans = {}
    for name in names:
        spec = reader.index.tensor(name).spec
        whole = type(spec)(name, spec.shape, spec.tp_dim, spec.tp_interleave)
        numel = int(np.prod(spec.shape))
        plans[name] = (reader.reads(whole, "param", 1, 0, 0, numel), numel, spec.shape)
    by_file: Dict[str, list] = {}
    for reads, _, _ in plans.values():
        for file, offset, n, _ in reads:
            by_file.setdefault(file, []).append((offset, 4 * n))
    for file, ranges in by_file.items():
        verify_ranges(ckpt, file, meta["files"][file], ranges)
    return {name: reader.read(reads, numel).view(shape)
            for name, (reads, numel, shape) in plans.items()}
