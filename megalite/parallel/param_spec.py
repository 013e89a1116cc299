"""How each local parameter relates to the global, serial tensor it is a piece of.

Every parameter of a model stage carries a `ParamSpec`: the global (HF) name, the global
logical shape, and how tensor parallelism splits it. Clipping, ZeRO, checkpoints and HF export
read these specs and need no special cases:

- `tp_dim=None`: replicated over the TP group (LayerNorm, row-parallel biases, wpe).
- `tp_dim=d`: split into `tp` equal chunks along dim d. With `tp_interleave=k` the dim is k
  stacked blocks, each split separately — HF's fused `c_attn` is [q | k | v] along the output
  dim, and TP rank r holds [q_r | k_r | v_r] so that its heads stay whole (Llama's fused
  [gate | up] likewise).
- `tp_replicas=k`: dim d is split into tp / k chunks only, chunk c held alike by the k TP ranks
  c·k ... c·k + k − 1 (grouped-query attention with tp > n_kv_head: the ranks whose query heads
  read one KV head all hold it, as Megatron replicates query groups). Each of the k computes
  its own part of the gradient (from its query heads); the engine sums them
  (`megalite.parallel.grad_sums.sum_tp_shares`), and norms and checkpoints count the first of
  the k only (`tp_writer`).
- `padded_rows=P`: dim 0 is zero-padded from the logical size to P before splitting (the
  vocabulary, padded to a multiple of 128·tp so each TP rank gets an equal, aligned slice).
- `tied=True`: the token embedding that the LM head shares (both copies when the pipeline puts
  them on different stages: their gradients are summed over the embedding group).
- `expert=True`: a routed expert weight, stacked [E, ...] over the experts; with expert
  parallelism (ep > 1) each EP rank holds E/ep consecutive experts, rows [r·E/ep, (r+1)·E/ep)
  of dim 0 — a contiguous range of the flattened tensor, so a checkpoint records it as that
  range of the whole tensor (`expert_offset`) and any ep reads it back.
- `tp_folded=True`: an expert weight under expert parallelism (ep > 1) is not split over TP
  (expert TP = 1: EP folds over the TP ranks, Megatron-Core's MoE parallel folding): each TP
  rank holds whole experts, its EP rank's, so `tp_dim` keeps the axis a TP split would cut
  (a checkpoint reslices it for a layout with ep = 1) and the TP split counts as tp = 1.
- `tied_copy=True`: this parameter is a second copy of another one (the last pipeline stage's
  LM head = the first stage's token embedding); norms and exports count it once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int] = None
    tp_interleave: int = 1
    padded_rows: Optional[int] = None
    tied: bool = False
    tied_copy: bool = False
    tp_replicas: int = 1
    expert: bool = False
    tp_folded: bool = False

    @property
    def tp_replicated(self) -> bool:
        return self.tp_dim is None

    def tp_writer(self, tp_rank: int) -> bool:
        """Whether TP rank `tp_rank` holds the first copy of its slice (the one counted in
        norms and written to checkpoints): rank 0 of a TP-replicated tensor, the first of each
        group of `tp_replicas`, every rank of a plain split."""
        if self.tp_dim is None:
            return tp_rank == 0
        return tp_rank % self.tp_replicas == 0

    def tp_chunks(self, tp: int, tp_rank: int) -> Tuple[int, int]:
        """(the distinct chunks dim `tp_dim` is cut into at `tp`, the one `tp_rank` holds)."""
        if self.tp_folded:
            return 1, 0
        return tp // self.tp_replicas, tp_rank // self.tp_replicas

    @property
    def weight_decay(self) -> bool:
        """Matrices and embeddings decay; biases and LayerNorm parameters do not."""
        return len(self.shape) >= 2

    def padded_shape(self) -> Tuple[int, ...]:
        if self.padded_rows is None:
            return self.shape
        return (self.padded_rows, *self.shape[1:])

    def local_shape(self, tp: int, ep: int = 1) -> Tuple[int, ...]:
        shape = list(self.padded_shape())
        if self.expert and ep > 1:
            if shape[0] % ep:
                raise ValueError(f"{self.name}: {shape[0]} experts do not split over ep={ep}")
            shape[0] //= ep
        if self.tp_dim is not None:
            parts = self.tp_chunks(tp, 0)[0]
            if tp % self.tp_replicas or shape[self.tp_dim] % (parts * self.tp_interleave):
                raise ValueError(f"{self.name}: dim {self.tp_dim} of {tuple(shape)} does not "
                                 f"split into {self.tp_interleave} x {parts} equal parts "
                                 f"(tp={tp}, {self.tp_replicas} ranks a part)")
            shape[self.tp_dim] //= parts
        return tuple(shape)

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        if self.padded_rows is None or self.padded_rows == full.shape[0]:
            return full
        extra = full.new_zeros((self.padded_rows - full.shape[0], *full.shape[1:]))
        return torch.cat([full, extra])

    def expert_offset(self, ep_rank: int, ep: int) -> int:
        """Where EP rank `ep_rank`'s experts start in the flattened tensor (0 but for an
        expert weight at ep > 1)."""
        if not self.expert or ep == 1:
            return 0
        numel = 1
        for n in self.shape:
            numel *= n
        return ep_rank * (numel // ep)

    def shard(self, full: torch.Tensor, tp_rank: int, tp: int, ep_rank: int = 0,
              ep: int = 1) -> torch.Tensor:
        """This TP (and, for an expert weight, EP) rank's piece of the global (logical,
        unpadded) tensor."""
        if tuple(full.shape) != self.shape:
            raise ValueError(f"{self.name}: expected global shape {self.shape}, got "
                             f"{tuple(full.shape)}")
        if self.expert and ep > 1:
            full = full.chunk(ep, dim=0)[ep_rank]
        full = self.pad(full)
        parts, part = self.tp_chunks(tp, tp_rank)
        if self.tp_dim is None or parts == 1:
            return full
        blocks = full.chunk(self.tp_interleave, dim=self.tp_dim)
        return torch.cat([b.chunk(parts, dim=self.tp_dim)[part] for b in blocks],
                         dim=self.tp_dim)

    def unshard(self, pieces: List[torch.Tensor]) -> torch.Tensor:
        """The global (logical, unpadded) tensor from every TP rank's piece, in rank order."""
        pieces = pieces[::self.tp_replicas] if len(pieces) > 1 and not self.tp_folded \
            else pieces[:1]
        if self.tp_dim is None or len(pieces) == 1:
            full = pieces[0]
        else:
            per_rank = [p.chunk(self.tp_interleave, dim=self.tp_dim) for p in pieces]
            full = torch.cat([torch.cat([blocks[i] for blocks in per_rank], dim=self.tp_dim)
                              for i in range(self.tp_interleave)], dim=self.tp_dim)
        return full[:self.shape[0]] if self.padded_rows is not None else full


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of `multiple`·tp (Megatron's
    make-vocab-size-divisible-by): equal TP slices, aligned for tensor cores."""
    step = multiple * tp
    return -(-vocab_size // step) * step
