"""The matrix's short documents and its checks that a document-masked run's windows let the
mask act (`megalite.testing.documents`): the short documents pass them, the stdlib corpus the
matrix trained on before fails them, and documents that end at the CP chunk cuts fail the CP
one."""
from __future__ import annotations

import numpy as np

from megalite.data.loader import TokenShards
from megalite.testing.documents import (
    LONGEST,
    cp_cuts,
    document_failures,
    document_ids,
    short_documents,
)

SEQ = 32  # the matrix's train.seq_len


def _windows(data, count=None) -> np.ndarray:
    shards = TokenShards(data, "train")
    n = shards.num_samples(SEQ)
    return shards.samples(np.arange(n if count is None else min(count, n)), SEQ)


def _read(windows, eos_id):
    return [{"windows": windows, "eos_id": eos_id}]


def test_cp_cuts_are_where_two_ranks_chunks_meet():
    assert cp_cuts(32, 2) == [8, 24]  # chunks 0 | 1 2 | 3: ranks 0 | 1 1 | 0
    assert cp_cuts(32, 4) == [4, 8, 12, 20, 24, 28]  # rank 3 keeps chunks 3 and 4


def test_every_window_of_the_short_documents_holds_boundaries_and_crossings(tmp_path):
    windows = _windows(short_documents(tmp_path / "short"))
    ids = document_ids(windows, 0)
    assert (ids[:, -1] >= (SEQ - 1) // LONGEST).all()  # a few documents in every window
    for cp in (1, 2, 4):
        assert document_failures(_read(windows, 0), cp) == []


def test_the_stdlib_corpus_fails_the_document_checks(tiny_data):
    """The matrix's corpus before: source files of thousands of tokens."""
    windows = _windows(tiny_data, 24)  # 3 steps of the matrix's global batch of 8
    eos = int(TokenShards(tiny_data, "train").meta["eos_token_id"])
    (bare, crossing) = document_failures(_read(windows, eos), 2)
    assert "windows read hold no document boundary" in bare
    assert "crosses a cut between CP ranks' chunks" in crossing


def test_documents_ending_at_the_chunk_cuts_fail_the_cp_check():
    windows = np.ones((4, SEQ + 1), dtype=np.int64)
    windows[:, [7, 15, 23]] = 0  # documents 0-7, 8-15, 16-23, 24-31: none crosses a cut
    assert document_failures(_read(windows, 0), 1) == []
    assert document_failures(_read(windows, 0), 4) == []  # 8-15 crosses the cut at 12
    (failure,) = document_failures(_read(windows, 0), 2)
    assert "at cp 2" in failure and "[8, 24]" in failure
    windows[2, 7] = 1  # one document 0-15 crosses the cut at 8, but it starts the window
    assert len(document_failures(_read(windows, 0), 2)) == 1
    windows[2, 3] = 0  # it starts at 4 now: the queries at 8.. must not see keys 0-3
    assert document_failures(_read(windows, 0), 2) == []
