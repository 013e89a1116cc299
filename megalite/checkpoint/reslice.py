"""Which elements of the writer's TP slices make up a range of the reader's TP slice.

A TP split cuts one axis `d` of a tensor (ParamSpec.tp_dim): padded to P (the vocabulary rows),
cut into `tp_interleave` = k stacked blocks of P/k, each block cut into tp chunks of P/(k·tp);
TP rank r holds chunk r of every block. Along that axis, local index j of rank r is global index

    g(j) = (j // c)·(P/k) + r·c + j mod c,    c = P/(k·tp),

and every other axis is whole. So a flattened slice, viewed as (outer, axis, inner) with outer
the product of the dims before d and inner of those after, maps onto the writer's slices in runs:
for each outer index o and each stretch of axis indices that stays inside one chunk of the
reader and one chunk of a writer, the elements (o·A + j)·inner ... are contiguous on both sides.
Rows past the logical size (the padding) are read from nobody: they stay zero. A slice that k TP
ranks share (`ParamSpec.tp_replicas`) is cut tp / k ways, chunk r // k on rank r, and was
written by the first of its k ranks.

This lets a resume under a changed TP size read exactly its own elements of the checkpoint
(O(its share) per rank) instead of rebuilding every global tensor of its stage.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import numpy as np

from megalite.parallel.param_spec import ParamSpec


class Run(NamedTuple):
    """`length` elements: the writer TP rank `writer`'s flattened slice from `src` on, into the
    reader's range from `dst` on (relative to the range's start)."""
    writer: int
    src: int
    dst: int
    length: int


def _axis(spec: ParamSpec) -> Tuple[int, int, int, int]:
    """(split axis, its padded size, its logical size, k); a replicated tensor is one chunk of
    axis 0."""
    d = spec.tp_dim if spec.tp_dim is not None else 0
    padded, logical = spec.padded_shape()[d], spec.shape[d]
    return d, padded, logical, spec.tp_interleave if spec.tp_dim is not None else 1


def _chunks(spec: ParamSpec, tp: int, rank: int) -> List[Tuple[int, int, int]]:
    """(local start, global start, length) of each chunk of the split axis that `rank` holds,
    clipped to the logical size (padding rows belong to nobody)."""
    _, padded, logical, k = _axis(spec)
    if spec.tp_dim is None:
        tp, rank = 1, 0
    else:
        tp, rank = spec.tp_chunks(tp, rank)
    block, c = padded // k, padded // (k * tp)
    out = []
    for b in range(k):
        g = b * block + rank * c
        n = min(c, logical - g)
        if n > 0:
            out.append((b * c, g, n))
    return out


def axis_segments(reader: ParamSpec, tp: int, rank: int, writer: ParamSpec, writer_tp: int
                  ) -> List[Tuple[int, int, int, int]]:
    """(reader local start, writer rank, writer local start, length) along the split axis:
    the reader's chunks cut where they cross writers' chunks."""
    ranks = range(0, writer_tp, writer.tp_replicas) if writer.tp_dim is not None else range(1)
    writers = [(w, *chunk) for w in ranks for chunk in _chunks(writer, writer_tp, w)]
    segments = []
    for local, g, n in _chunks(reader, tp, rank):
        for w, w_local, w_g, w_n in writers:
            a, b = max(g, w_g), min(g + n, w_g + w_n)
            if a < b:
                segments.append((local + a - g, w, w_local + a - w_g, b - a))
    return sorted(segments)


def runs(reader: ParamSpec, tp: int, rank: int, writer: ParamSpec, writer_tp: int,
         lo: int, hi: int) -> List[Run]:
    """The runs that fill elements [lo, hi) of `rank`'s flattened slice of `reader` (split
    over `tp`) from a checkpoint whose slices were cut by `writer` over `writer_tp`. Elements
    in no run are padding (zero)."""
    d = _axis(reader)[0]
    local, written = reader.local_shape(tp), writer.local_shape(writer_tp)
    inner = int(np.prod(local[d + 1:], dtype=np.int64))
    a_new, a_old = local[d], written[d]
    row = a_new * inner  # elements per outer index
    rows = np.arange(lo // row, (hi - 1) // row + 1, dtype=np.int64) if hi > lo else \
        np.empty(0, dtype=np.int64)
    out: List[Run] = []
    for start, w, w_start, n in axis_segments(reader, tp, rank, writer, writer_tp):
        dst_a = (rows * a_new + start) * inner
        a = np.maximum(dst_a, lo)
        b = np.minimum(dst_a + n * inner, hi)
        keep = a < b
        src = (rows[keep] * a_old + w_start) * inner + (a - dst_a)[keep]
        out.extend(Run(w, int(s), int(t) - lo, int(e - t))
                   for s, t, e in zip(src, a[keep], b[keep]))
    out.sort(key=lambda r: r.dst)
    return out


def same_split_axis(reader: ParamSpec, writer: ParamSpec) -> bool:
    """The two specs cut the same axis into the same blocks (only tp, padding and the TP
    ranks sharing a slice may differ)."""
    return reader.tp_dim == writer.tp_dim and reader.tp_interleave == writer.tp_interleave \
        and reader.shape == writer.shape
