"""A model's sharding units (each chunk's `sharding_units()`: embeddings, each block, the final
norm, the LM head) in forward order, and the flat buckets their parameters live in: where the
optimizer offload waits for a bucket's host step and ZeRO 1/2's overlapped parameter gather
launches a bucket's all-gather, both in the order a forward first reads them.
"""
from __future__ import annotations

from typing import List


def unit_buckets(chunks, buckets) -> List[tuple]:
    """(unit, the buckets holding its parameters) for each chunk's sharding units, in forward
    order."""
    by_param = {id(p): b for b in buckets for p in b.params}
    out = []
    for chunk in chunks:
        for unit in chunk.sharding_units():
            mine: List = []
            for p in unit.parameters():
                b = by_param.get(id(p))
                if b is not None and all(b is not o for o in mine):
                    mine.append(b)
            out.append((unit, mine))
    return out


def forward_order(chunks, buckets) -> List:
    """Buckets in the order of their first use in a forward (each chunk's sharding units)."""
    order: List = []
    for _, mine in unit_buckets(chunks, buckets):
        order += [b for b in mine if all(b is not o for o in order)]
    return order + [b for b in buckets if all(b is not o for o in order)]
