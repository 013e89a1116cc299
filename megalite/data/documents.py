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
(`visible_pairs`: the attention FLOPs computed under the mask, logged beside MFU's dense count).

Per window O(seq_len) work on the tokens just read; nothing is scanned at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megalite.data.errors import DataError


@dataclass(frozen=True)
class Documents:
    """The per-token document structure of a micro-batch of inputs [b, s]; a part the run
    does not use is None (then: attention across documents, positions 0..s-1, every target
    counted)."""

    ids: Optional[torch.Tensor] = None  # [b, s] int64, document of each input token
    positions: Optional[torch.Tensor] = None  # [b, s] int64, position within its document
    counted: Optional[torch.Tensor] = None  # [b, s] bool, targets that count in the loss
    visible_pairs: int = 0  # (query, key) pairs the document mask leaves: Σ n(n+1)/2

    def to(self, device: torch.device) -> "Documents":
        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device, non_blocking=True)

        return Documents(move(self.ids), move(self.positions), move(self.counted),
                         self.visible_pairs)


@dataclass(frozen=True)
class DocumentRule:
    """Which parts of `Documents` a run uses (`train.attention_mask`, `train.reset_positions`,
    `train.eos_loss`) and the data's EOS id (meta.json's eos_token_id)."""

    eos_id: int
    mask: bool = True  # train.attention_mask=document
    reset_positions: bool = False
    eos_loss: bool = True

    def of(self, inputs: np.ndarray) -> Documents:
        """The documents of windows' inputs, a (k, seq_len) integer array."""
        eos = inputs == self.eos_id
        ids = np.zeros(inputs.shape, dtype=np.int64)
        np.cumsum(eos[:, :-1], axis=1, out=ids[:, 1:])
        positions = None
        if self.reset_positions:
            t = np.arange(inputs.shape[1], dtype=np.int64)
            starts = np.zeros(inputs.shape, dtype=np.int64)
            starts[:, 1:] = np.where(eos[:, :-1], t[1:], 0)
            positions = torch.from_numpy(t - np.maximum.accumulate(starts, axis=1))
        return Documents(ids=torch.from_numpy(ids) if self.mask else None,
                         positions=positions,
                         counted=None if self.eos_loss else torch.from_numpy(~eos),
                         visible_pairs=visible_pairs(eos) if self.mask else 0)


def visible_pairs(eos: np.ndarray) -> int:
    """(query, key) pairs attention within documents computes for windows' inputs whose EOS
    tokens are `eos` (k, s): Σ over the documents of each window of n(n+1)/2, n its tokens in
    the window (causal attention over the whole window: s(s+1)/2 a window)."""
    k, s = eos.shape
    starts = np.ones((k, s), dtype=bool)
    starts[:, 1:] = eos[:, :-1]
    lengths = np.diff(np.append(np.flatnonzero(starts), k * s))
    return int((lengths * (lengths + 1) // 2).sum())


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
