"""The context-parallel attention kernels' work under the document mask, as the plan prices it
(`megalite.plan.document_terms.masking`), by the kernels' own rule
(`megalite.parallel.context_attention`).

A window of s tokens is cut into 2·cp chunks of c = s/(2·cp); CP rank r holds chunks r and
2·cp − 1 − r (`megalite.parallel.context_shard`). Without the mask query chunk j attends to key
chunks 0..j: (j + 1)·c² scores a window (the diagonal chunk computed in full), the kernels'
causal plan, the same on every rank's two chunks (2·cp + 1 chunk pairs). Under the mask, with
F_j the first position of the document that holds chunk j's first token, the smallest over the
micro-batch's windows (the ring decides per micro-batch: a chunk pair is skipped only where
every sequence of the batch allows it):

  ring       key chunk i < j is skipped iff its last token's document ends before chunk j's
             first token's starts in every window, i.e. F_j >= (i + 1)·c: ⌊F_j / c⌋ of the
             j + 1 chunk pairs skipped, (j + 1 − ⌊F_j / c⌋)·c² scores computed
  allgather  each window's chunk j is cut at its documents' starts into pieces, and a piece
             [p, p + n) computes the keys from its document's start to its own end:
             Σ n·(p + n − start) computed per window (`piece_work`; the pieces are per
             sequence, so the micro-batch's windows add), (j + 1)·c² − that skipped

Both are exactly the `AttentionWork` counters (`computed`, `skipped`; their sum the causal
plan). `cp_masked_work` gives their ratio computed / (computed + skipped) over all ranks
(`mean`) and the largest rank's share of its own causal plan, averaged over micro-batches
(`slowest`): the ranks' shares differ under the mask (the zigzag balances the causal work,
not the documents) and each layer's collectives (the all-gather, the ring's sends) wait for
the slowest rank, so the time model charges `slowest`, at the rate `document_terms.masking`
gives each kernel.

The windows come from the plan's corpus sample (`DocumentSample`: only where each document
starts, so any cp is priced from it without reading the corpus again); micro-batches of b
windows are formed from it strided, window g, g + k/b, g + 2k/b, ... (windows far apart in
the sample, as a shuffled run draws them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megalite.data.sampler import blend_choices
from megalite.parallel import context_shard


@dataclass(frozen=True, eq=False)
class DocumentSample:
    """Where the documents of k windows of s tokens start: `starts`, ascending, holds
    w·s + t for each token t of window w that starts a document (t = 0 always: the window's
    first token starts its first, possibly cut, document)."""

    seq_len: int
    windows: int
    starts: np.ndarray

    @classmethod
    def of(cls, eos: np.ndarray) -> "DocumentSample":
        """The sample of windows' inputs whose EOS tokens are `eos` (k, s): a token after
        an EOS starts a document (`megalite.data.documents`)."""
        k, s = eos.shape
        w, t = np.nonzero(eos[:, :-1])
        return cls(s, k, np.union1d(np.arange(k, dtype=np.int64) * s, w * s + t + 1))

    @classmethod
    def blended(cls, samples: Sequence["DocumentSample"], weights: Sequence[float]
                ) -> "DocumentSample":
        """The windows of a data.blend's samples as a run draws them: dataset by dataset in
        the blend's order (`megalite.data.sampler.blend_choices`, Σ k windows), each
        dataset's windows in turn, the whole shuffled (seed 0) as a run's sample order is, so
        that a micro-batch mixes the datasets as training's do."""
        s, n = samples[0].seq_len, sum(x.windows for x in samples)
        order = blend_choices(weights, [0] * len(samples), n)
        taken, parts = [0] * len(samples), []
        for w, d in enumerate(np.random.default_rng(0).permutation(order)):
            src, i = samples[d], taken[d] % samples[d].windows
            taken[d] += 1
            lo, hi = np.searchsorted(src.starts, [i * s, (i + 1) * s])
            parts.append(src.starts[lo:hi] + (w - i) * s)
        return cls(s, n, np.concatenate(parts))

    def document_start(self, positions: np.ndarray) -> np.ndarray:
        """(k, n): the first position of the document that holds each of `positions` (n,)
        in each window."""
        base = np.arange(self.windows, dtype=np.int64)[:, None] * self.seq_len
        at = np.searchsorted(self.starts, base + positions[None, :], side="right") - 1
        return self.starts[at] - base


@dataclass(frozen=True)
class CpMaskedWork:
    """The CP kernel's computed scores over its causal plan's (module docstring)."""

    mean: float  # over all ranks and micro-batches: Σ computed / Σ (computed + skipped)
    slowest: float  # the largest rank's computed / its causal plan, averaged over micro-batches


def _micro_batches(first: np.ndarray, batch: int, reduce=np.min) -> np.ndarray:
    """(groups, n) from (k, n) per-window values: `reduce` (the smallest, or the sum) over
    each strided micro-batch of `batch` windows (all k where fewer)."""
    k = first.shape[0]
    groups = max(1, k // batch)
    per = k if k < batch else batch
    return reduce(first[:per * groups].reshape(per, groups, -1), axis=0)


def piece_work(sample: DocumentSample, c: int) -> np.ndarray:
    """(k, s / c): the all-gather kernel's computed scores of each window's chunks: every
    chunk cut at its documents' starts into pieces, a piece [p, p + n) computing the keys
    [its document's start, p + n) (`megalite.parallel.context_documents`)."""
    s, k = sample.seq_len, sample.windows
    cuts = np.union1d(sample.starts, np.arange(0, k * s, c))
    ends = np.append(cuts[1:], k * s)
    key_start = sample.starts[np.searchsorted(sample.starts, cuts, side="right") - 1]
    out = np.zeros(k * (s // c), dtype=np.int64)
    np.add.at(out, cuts // c, (ends - cuts) * (ends - key_start))
    return out.reshape(k, s // c)


def cp_masked_work(sample: DocumentSample, cp: int, comm: str, batch: int) -> CpMaskedWork:
    """The `comm` kernel's work at `cp` > 1 for micro-batches of `batch` windows of `sample`
    (at cp 1 no CP kernel runs: `megalite.model.document_attention`'s)."""
    c = context_shard.chunk_len(sample.seq_len, cp)
    j = np.arange(2 * cp)
    per = min(batch, sample.windows)
    if comm == "ring":
        start = _micro_batches(sample.document_start(j * c), batch)  # F_j, (groups, 2cp)
        computed = per * (j + 1 - start // c) * c * c
    else:
        computed = _micro_batches(piece_work(sample, c), batch, np.sum)
    plan = per * (j + 1) * c * c
    chunks = np.array([context_shard.chunk_ids(cp, r) for r in range(cp)])  # (cp, 2)
    per_rank = computed[:, chunks].sum(axis=2)  # (groups, cp)
    rank_plan = plan[chunks].sum(axis=1)  # (2·cp + 1)·c² on every rank
    return CpMaskedWork(float(computed.sum() / (plan.sum() * len(computed))),
                        float((per_rank / rank_plan).max(axis=1).mean()))
