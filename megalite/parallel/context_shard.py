"""Load-balanced sequence sharding for context parallelism (CP).

A sequence of S tokens is cut into 2·cp chunks of c = S / (2·cp) tokens; CP rank r keeps chunks
r and 2·cp − 1 − r, in that order ("zigzag", as Megatron-Core's and torchtitan's CP do). Under
causal attention chunk j attends to j + 1 chunks' keys, so every rank's two chunks together
attend to (r + 1) + (2·cp − r) = 2·cp + 1 chunks: the work is the same on every rank.

Positions stay global: a rank's tokens are at `positions(S, cp, r)` of the sequence, which is
what RoPE and learned position embeddings index.
"""
from __future__ import annotations

from typing import List, Tuple

import torch


def chunk_ids(cp: int, cp_rank: int) -> Tuple[int, int]:
    """The two global chunk indices CP rank `cp_rank` keeps, in its local order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} outside cp={cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_len(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len={seq_len} is not divisible by 2·cp = {2 * cp}: "
                         f"use a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of CP rank `cp_rank`'s local tokens (length seq_len / cp)."""
    c = chunk_len(seq_len, cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device)
                      for j in chunk_ids(cp, cp_rank)])


def shard(x: torch.Tensor, cp: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the whole sequence), concatenated."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[j] for j in chunk_ids(cp, cp_rank)], dim=dim)


def rank_major_order(cp: int) -> List[int]:
    """Global chunk indices in the order an all-gather over CP lays them out (rank 0's two
    chunks, then rank 1's, ...)."""
    return [j for r in range(cp) for j in chunk_ids(cp, r)]


def unshard(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Every rank's local tokens, concatenated in rank order along `dim` (an all-gather's
    output), back in the sequence's order."""
    if cp == 1:
        return gathered
    chunks = gathered.chunk(2 * cp, dim=dim)
    at = {j: i for i, j in enumerate(rank_major_order(cp))}
    return torch.cat([chunks[at[j]] for j in range(2 * cp)], dim=dim)


def reshard(full: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The inverse of `unshard`: the sequence's chunks in all-gather (rank-major) order."""
    if cp == 1:
        return full
    chunks = full.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[j] for j in rank_major_order(cp)], dim=dim)
