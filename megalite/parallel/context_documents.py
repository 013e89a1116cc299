"""What the context-parallel (CP) attention kernels take under the document mask
(`train.attention_mask=document`), made on the host once per micro-batch from the batch's
windows (`megalite.data.documents.DocumentRule.of`), so that no layer reads the device.

Documents are contiguous runs of a window, so query t sees key u under the mask iff

    first[t] <= u <= t,

`first[t]` the global position of the first token of t's document. `DocumentSpans` holds, for
one CP rank's chunks (`megalite.parallel.context_shard`):

  first        [b, L] int64, `first` of each local token (moved to the device with the batch):
               the ring's per-chunk-pair mask (u >= first[t], beside the causal one) and
               FlexAttention's `mask_mod` on CUDA (`block_mask`)
  pieces       the local queries cut at every chunk and document boundary, per sequence:
               (sequence, local start, local end, global start, key start) — a piece's
               queries see the keys [key start, global start) in full and their own causally,
               the CPU all-gather kernel's two maskless flash calls a piece
  chunk_first  F_j for each global chunk j: the smallest `first` of chunk j's first token over
               the micro-batch; the ring skips key chunk i < j iff F_j >= (i + 1)·c

No [b, 1, c, S] mask exists: the CUDA block mask (built once per micro-batch, compiled, and
cached here) holds int32 block counts and indices, about 4·b·(L/128)·(S/128)·4 bytes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Tuple

import numpy as np
import torch

from megalite.parallel import context_shard

FLEX_BLOCK = 128  # FlexAttention's default block (query and key tokens)

Piece = Tuple[int, int, int, int, int]  # (sequence, local start, local end, global start, key start)


@dataclass(frozen=True)
class DocumentSpans:
    """One CP rank's documents for one micro-batch (module docstring)."""

    first: torch.Tensor  # [b, L] int64
    pieces: Tuple[Piece, ...]
    chunk_first: Tuple[int, ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(first: np.ndarray, cp: int, cp_rank: int) -> "DocumentSpans":
        """The spans of CP rank `cp_rank` of `cp` from `first` (k, s): each window token's
        document's first position (`megalite.data.documents.in_document_positions`: t minus
        it)."""
        b, s = first.shape
        c = context_shard.chunk_len(s, cp)
        pieces = []
        for i, j in enumerate(context_shard.chunk_ids(cp, cp_rank)):
            chunk = first[:, j * c:(j + 1) * c]
            for seq in range(b):
                cuts = np.flatnonzero(chunk[seq, 1:] != chunk[seq, :-1]) + 1
                bounds = [0, *cuts.tolist(), c]
                pieces += [(seq, i * c + lo, i * c + hi, j * c + lo, int(chunk[seq, lo]))
                           for lo, hi in zip(bounds[:-1], bounds[1:])]
        local = context_shard.shard(torch.from_numpy(np.ascontiguousarray(first)), cp,
                                    cp_rank, dim=1)
        return DocumentSpans(local, tuple(pieces),
                             tuple(int(first[:, j * c].min()) for j in range(2 * cp)))

    def to(self, device: torch.device) -> "DocumentSpans":
        return replace(self, first=self.first.to(device, non_blocking=True), _cache={})

    def visible(self, local: slice, key_start: int, keys: int) -> torch.Tensor:
        """[b, len(local), keys] bool: the keys at global positions key_start.. that the
        local queries' documents hold (u >= first; causality is the caller's)."""
        u = torch.arange(key_start, key_start + keys, device=self.first.device)
        return u[None, None, :] >= self.first[:, local, None]

    def block_mask(self, positions: torch.Tensor, kv_len: int, block: int = FLEX_BLOCK):
        """FlexAttention's block mask of the local queries (global `positions` [L]) over the
        gathered keys [0, kv_len): first[t] <= u <= t. Built once (cached): compiled on CUDA,
        which never forms the [L, kv_len] mask; eagerly elsewhere."""
        key = (kv_len, block)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            first = self.first

            def same_document_causal(b, h, q_idx, kv_idx):
                return (kv_idx <= positions[q_idx]) & (kv_idx >= first[b, q_idx])

            self._cache[key] = create_block_mask(
                same_document_causal, B=first.shape[0], H=None, Q_LEN=first.shape[1],
                KV_LEN=kv_len, device=first.device, BLOCK_SIZE=block,
                _compile=first.device.type == "cuda")
        return self._cache[key]


def block_mask_bytes(batch: int, local: int, seq_len: int, block: int = FLEX_BLOCK) -> int:
    """The bytes of `block_mask`'s tensors at most: int32 counts [b, ⌈L/B⌉] and indices
    [b, ⌈L/B⌉, ⌈S/B⌉] for the partial and the full blocks, and the same transposed for the
    backward."""
    q_blocks, kv_blocks = -(-local // block), -(-seq_len // block)
    return 4 * 2 * batch * (q_blocks * (kv_blocks + 1) + kv_blocks * (q_blocks + 1))


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """FlexAttention compiled (static shapes): the CUDA document kernels'."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def chunk_pieces(chunks: Tuple[int, int], c: int) -> Tuple[Piece, ...]:
    """Causal attention's pieces (no documents): each local chunk over every sequence
    (sequence -1: all), its keys from the sequence's start."""
    return tuple((-1, i * c, (i + 1) * c, j * c, 0) for i, j in enumerate(chunks))

