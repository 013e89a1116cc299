"""The documents of a packed window, found from its EOS tokens as the window is loaded.

Prepared data packs documents end to end, each followed by EOS (`megalite.data.tokenize`). For
the inputs x of a window (its first seq_len tokens), token t belongs to document

    ids[t] = number of EOS among x[0..t-1]

so an EOS belongs to the document it ends, and the next token starts a new one (Megatron's
`get_ltor_masks_and_position_ids`: the same boundaries for --reset-attention-mask,
--reset-position-ids and --eod-mask-loss). Ids count from 0 within each window; a window that
starts inside a document gives that document's tail id 0. From the ids:

  positions[t] = t - (the first index of document ids[t])   (train.reset_positions)
  counted[t]   = x[t] != EOS                                 (train.eos_loss=false: the target
                                                              after an EOS, the next document's
                                                              first token, does not count)

and the attention work the mask leaves, Σ over documents of n(n+1)/2 (query, key) pairs
(`visible_pairs`: the attention FLOPs computed under the mask, logged beside MFU's dense count;
query t sees positions[t] + 1 keys).

With context parallelism all is found over the whole window and each CP rank keeps its chunks
(`megalite.parallel.context_shard`): its tokens' global ids, their positions in their
documents, their counted targets, the visible pairs of its own queries (summed over CP: the
window's, each pair once), and under the mask the spans the CP attention kernels take
(`megalite.parallel.context_documents.DocumentSpans`, made here on the host).

The loss under train.eos_loss=false is Megatron's per-token loss: the sum over the step's
counted targets divided by their count over the whole step (every micro-batch and DP x CP
rank), not a mean per micro-batch or rank (a CP rank's chunks, a DP replica's windows hold
unequal counts). `loss_share` = that count / (micro-batches x ranks), set by the trainer after
one all-reduce of the counts (`with_loss_share`); a micro-batch's loss is its summed counted
losses / loss_share, so the mean over micro-batches and ranks that the pipeline and the
trainer take is the step's mean per counted target: the serial run's, whatever the layout.

Per window O(seq_len) work on the tokens just read; nothing is scanned at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from megalite.data.errors import DataError
from megalite.parallel import context_shard
from megalite.parallel.context_documents import DocumentSpans


@dataclass(frozen=True)
class Documents:
    """The per-token document structure of a micro-batch of inputs [b, s]; a part the run
    does not use is None (then: attention across documents, positions 0..s-1, every target
    counted)."""

    ids: Optional[torch.Tensor] = None  # [b, s] int64, document of each input token
    positions: Optional[torch.Tensor] = None  # [b, s] int64, position within its document
    counted: Optional[torch.Tensor] = None  # [b, s] bool, targets that count in the loss
    visible_pairs: int = 0  # (query, key) pairs the document mask leaves: Σ n(n+1)/2
    loss_share: Optional[float] = None  # counted targets per micro-batch and rank of the step
    # the variable-length kernel's pieces (`packed_sequences`), made with the ids on the host
    # so that the GPU need not be waited for; None under cp > 1 (or where not made)
    cu_seqlens: Optional[torch.Tensor] = None
    longest: int = 0
    # under cp > 1 with the mask: what the CP attention kernels take, made on the host
    # (`megalite.parallel.context_documents`)
    spans: Optional[DocumentSpans] = None

    def to(self, device: torch.device) -> "Documents":
        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device, non_blocking=True)

        return dataclasses.replace(self, ids=move(self.ids), positions=move(self.positions),
                                   counted=move(self.counted), cu_seqlens=move(self.cu_seqlens),
                                   spans=None if self.spans is None else self.spans.to(device))


@dataclass(frozen=True)
class DocumentRule:
    """Which parts of `Documents` a run uses (`train.attention_mask`, `train.reset_positions`,
    `train.eos_loss`) and the data's EOS id (meta.json's eos_token_id)."""

    eos_id: int
    mask: bool = True  # train.attention_mask=document
    reset_positions: bool = False
    eos_loss: bool = True

    def of(self, inputs: np.ndarray, cp: Tuple[int, int] = (1, 0)) -> Documents:
        """The documents of windows' inputs, a (k, seq_len) integer array, found over the
        whole windows; with `cp` = (size, rank), this CP rank's chunks of them
        (`megalite.parallel.context_shard`): the global ids, the restarted positions and the
        counted targets of its tokens, the visible pairs of its queries, and under the mask
        the spans the CP kernels take (`DocumentSpans`)."""
        eos = inputs == self.eos_id
        ids = np.zeros(inputs.shape, dtype=np.int64)
        np.cumsum(eos[:, :-1], axis=1, out=ids[:, 1:])
        in_document = in_document_positions(eos)
        size, rank = cp

        def local(values: np.ndarray) -> torch.Tensor:
            return context_shard.shard(torch.from_numpy(values), size, rank, dim=1)

        cu_seqlens, longest = packed_sequences(torch.from_numpy(ids)) \
            if self.mask and size == 1 else (None, 0)
        spans = DocumentSpans.of(np.arange(inputs.shape[1]) - in_document, size, rank) \
            if self.mask and size > 1 else None
        return Documents(ids=local(ids) if self.mask else None,
                         positions=local(in_document) if self.reset_positions else None,
                         counted=None if self.eos_loss else local(~eos),
                         visible_pairs=int(local(in_document + 1).sum()) if self.mask else 0,
                         cu_seqlens=cu_seqlens, longest=longest, spans=spans)


def packed_sequences(ids: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The documents of ids [b, s] as the variable-length attention kernel takes them (the b·s
    tokens row by row, one sequence a document): int32 [n + 1] cumulative lengths (where each
    of the n documents starts, then b·s; every window start is a cut) and the longest one.
    On a GPU tensor this waits for the device (`DocumentRule.of` makes them on the host)."""
    b, s = ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    cu = torch.cat([starts.flatten().nonzero().flatten(),
                    torch.tensor([b * s], device=ids.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def in_document_positions(eos: np.ndarray) -> np.ndarray:
    """Each token's position in its document, t - (the first index of its document), of
    windows whose EOS tokens are `eos` (k, s). Query t sees its position + 1 keys under the
    document mask: summed over a document of n tokens, its n(n+1)/2 visible pairs."""
    t = np.arange(eos.shape[1], dtype=np.int64)
    starts = np.zeros(eos.shape, dtype=np.int64)
    starts[:, 1:] = np.where(eos[:, :-1], t[1:], 0)
    return t - np.maximum.accumulate(starts, axis=1)


def visible_pairs(eos: np.ndarray) -> int:
    """(query, key) pairs attention within documents computes for windows whose EOS tokens
    are `eos` (k, s): Σ over each window's documents of n(n+1)/2 (the planner's sample)."""
    return int((in_document_positions(eos) + 1).sum())


def with_loss_share(micro_batches: Sequence[tuple], counted: float, ranks: int) -> List[tuple]:
    """The micro-batches (x, y, Documents) of one rank with `Documents.loss_share` set from
    `counted`, the counted targets of the step over all `ranks` (DP x CP) and micro-batches:
    counted / (micro-batches x ranks), at least 1 / that (a step with no counted target
    gives a loss of 0)."""
    share = max(counted, 1.0) / (len(micro_batches) * ranks)
    return [(x, y, dataclasses.replace(docs, loss_share=share)) for x, y, docs in micro_batches]


def counted_targets(micro_batches: Sequence[tuple]) -> int:
    """The targets of a rank's micro-batches (x, y, Documents) that count in the loss."""
    return int(sum(docs.counted.sum() for _, _, docs in micro_batches))  # one device sync


def document_rule(train, eos_id: Optional[int], data_dir) -> Optional[DocumentRule]:
    """The run's `DocumentRule` from its `train` section, None where no part is used (the
    batches are then (inputs, targets) as always). Raises where the data names no EOS."""
    if not train.uses_documents:
        return None
    if eos_id is None:
        raise DataError(f"{data_dir}: meta.json has no eos_token_id, which "
                        "train.attention_mask=document, train.reset_positions=true and "
                        "train.eos_loss=false need to find the documents; prepare the data "
                        "again with this megalite, or use the defaults")
    return DocumentRule(int(eos_id), mask=train.attention_mask == "document",
                        reset_positions=train.reset_positions, eos_loss=train.eos_loss)
