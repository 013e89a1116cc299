"""Short documents for the runs that test document masking, and the checks that the windows a
run read let the mask act.

A document-masked run trained on a corpus of long documents (source files of thousands of
tokens) reads windows with no end-of-document token: its mask is the causal one and it tests
causal attention. `short_documents` writes a corpus of random documents of a few tokens, so
every window of the matrix's 32 tokens holds several; `document_failures` holds what the
ranks of a run read to it: every window's inputs hold a boundary (an EOS before the last
input: the document ids then change inside the window), and under context parallelism some
document that starts inside a window (after an EOS) crosses a cut between the chunks of two
CP ranks (so a query on one rank must see some keys of another rank's chunk and not the keys
before its document's start). The ids are found here from the tokens, not by the code under
test (`megalite.data.documents`).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np

from megalite.data.token_arrays import write_token_arrays
from megalite.parallel.context_shard import chunk_ids, chunk_len

SHORTEST, LONGEST = 3, 20  # document lengths (tokens, the EOS included)


def short_documents(out: Path, tokens: int = 40_000, vocab: int = 1024) -> Path:
    """A prepared-data directory of random documents of SHORTEST-LONGEST tokens, each ended by
    EOS (id 0; the other ids drawn from 1..vocab-1), 90% train, 10% val. Any LONGEST
    consecutive tokens hold an EOS."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=tokens).astype(np.uint16)
    ends = np.cumsum(rng.integers(SHORTEST, LONGEST + 1, size=tokens // SHORTEST)) - 1
    ids[ends[ends < tokens]] = 0
    split = int(tokens * 0.9)
    return write_token_arrays(out, {"train": [ids[:split]], "val": [ids[split:]]}, vocab, 0,
                              f"random documents of {SHORTEST}-{LONGEST} tokens")


def document_ids(windows: np.ndarray, eos_id: int) -> np.ndarray:
    """The document of each input of windows [k, seq_len + 1]: the EOS tokens before it."""
    inputs = windows[:, :-1]
    ids = np.zeros(inputs.shape, dtype=np.int64)
    np.cumsum(inputs[:, :-1] == eos_id, axis=1, out=ids[:, 1:])
    return ids


def cp_cuts(seq_len: int, cp: int) -> List[int]:
    """The positions p where chunk p / c starts and the chunk before it is another CP rank's
    (`megalite.parallel.context_shard`: rank r keeps chunks r and 2·cp - 1 - r)."""
    c = chunk_len(seq_len, cp)
    owner = {j: r for r in range(cp) for j in chunk_ids(cp, r)}
    return [j * c for j in range(1, 2 * cp) if owner[j - 1] != owner[j]]


def document_failures(ranks: Sequence[dict], cp: int) -> List[str]:
    """What the windows read by a document-masked run's ranks (each result's "windows", the
    tokens [k, seq_len + 1] of its steps, and "eos_id"; a window that several ranks read
    counts once) lack: a boundary in every window, and with `cp` > 1 a document started inside
    a window crossing a cut between CP ranks' chunks. Empty when the mask acts as the run's
    name says."""
    windows = np.unique(np.concatenate([r["windows"] for r in ranks]), axis=0)  # TP, PP, CP
    (eos_id,) = {r["eos_id"] for r in ranks}
    ids = document_ids(windows, eos_id)
    failures = []
    bare = int((ids[:, -1] == 0).sum())
    if bare:
        failures.append(f"document mask: {bare} of the {len(ids)} windows read hold no document "
                        f"boundary (no EOS, id {eos_id}, before their last input): the mask "
                        "is causal attention there")
    if cp > 1:
        cuts = cp_cuts(ids.shape[1], cp)
        if not any(((ids[:, p - 1] == ids[:, p]) & (ids[:, p] > 0)).any() for p in cuts):
            failures.append(f"document mask at cp {cp}: no document that starts inside a "
                            f"window crosses a cut between CP ranks' chunks (at {cuts}) in the "
                            f"{len(ids)} windows read")
    return failures
