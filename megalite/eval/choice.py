"""Multiple-choice scoring through the pipeline, in any layout (HellaSwag's, as llm.c and
build-nanogpt score it).

For each example and each of its endings, the cross-entropy of the ending's tokens given the
context: L_k = sum over the ending's tokens t of -log p(t | everything before it), over n_k
tokens. The model's answer is

    acc:       argmin_k L_k          (the ending with the lowest summed loss)
    acc_norm:  argmin_k L_k / n_k    (the lowest mean loss per ending token)

lm-evaluation-harness's `acc_norm` divides by the ending's length in characters instead of
tokens (its `acc_bytes` by UTF-8 bytes), and its HellaSwag task renders the text differently
(activity label prefixed, WikiHow brackets removed), so its figures differ from these.

The pipeline moves fixed activation shapes (seq, micro_batch, h): every ending is one sequence,
padded on the right to one length (the longest of the set, at most train.seq_len; causal
attention makes the padding invisible to the real tokens), with the label -100 wherever a
prediction does not count (the context's tokens and the padding). The last pipeline stage
returns each sequence's summed loss (`GPT2.sequence_losses`: with TP the vocab-parallel
cross-entropy per token). The examples are split over the DP replicas in contiguous slices,
every replica running the same number of micro-batches (ZeRO-3 gathers over DP in every
forward); a vector of every ending's loss, zero where a rank has not computed it, summed over
the pipeline and DP groups, gives every rank every loss (a sum with zeros is exact). With
context parallelism each CP rank holds its two chunks of every sequence (inputs and labels,
`megalite.parallel.context_shard`) and sums the losses of its own tokens; the sum over the CP
group is the sequence's (a rank whose chunks hold only padding contributes an exact 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from megalite.parallel import comm, context_shard
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.topology import Topology

IGNORED = -100  # label of a position whose prediction does not count


@dataclass(frozen=True)
class Ending:
    """One (context, ending) sequence as the model reads it: `tokens` = context + ending, the
    first `scored_from` of them only context (their predictions do not count); at most
    seq_len + 1 tokens (the model reads all but the last and predicts all but the first)."""

    tokens: Tuple[int, ...]
    scored_from: int
    truncated: bool  # the context (or more) was cut on the left to fit

    @property
    def scored(self) -> int:
        """Ending tokens whose loss counts."""
        return len(self.tokens) - self.scored_from


@dataclass
class ChoiceSet:
    """Examples rendered into sequences: endings[e][k] is ending k of example e."""

    endings: List[List[Ending]]
    labels: List[int]

    @property
    def truncated(self) -> int:
        """Sequences cut on the left to fit seq_len + 1 tokens."""
        return sum(e.truncated for ex in self.endings for e in ex)

    def length(self, seq_len: int, multiple: int) -> int:
        """The padded sequence length the model reads: the longest input (tokens - 1) rounded
        up to `multiple`, at most seq_len (a multiple of `multiple` itself under SP)."""
        longest = max(len(e.tokens) - 1 for ex in self.endings for e in ex)
        return min(seq_len, math.ceil(longest / multiple) * multiple)


@dataclass
class ChoiceScores:
    """Every ending's summed loss and scored token count [examples, endings], the answers."""

    losses: torch.Tensor  # fp64
    counts: torch.Tensor  # int64
    labels: torch.Tensor  # int64 [examples]

    @property
    def acc(self) -> float:
        return (self.losses.argmin(dim=1) == self.labels).double().mean().item()

    @property
    def acc_norm(self) -> float:
        mean = self.losses / self.counts
        return (mean.argmin(dim=1) == self.labels).double().mean().item()


def padded(ending: Ending, length: int) -> Tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one ending, right-padded to `length`: inputs = tokens[:-1],
    labels = tokens[1:] where the prediction counts, IGNORED elsewhere."""
    tokens = np.asarray(ending.tokens, dtype=np.int64)
    x = np.zeros(length, dtype=np.int64)
    y = np.full(length, IGNORED, dtype=np.int64)
    x[:len(tokens) - 1] = tokens[:-1]
    y[ending.scored_from - 1:len(tokens) - 1] = tokens[ending.scored_from:]
    return x, y


class _MicroBatches(Sequence):
    """This rank's micro-batches, each built when the schedule reads it (the whole set, padded
    to train.seq_len, need not sit in memory). Beyond the rank's endings: empty sequences
    (every label IGNORED) that fill the last micro-batch and the count all ranks share.
    `cp` = (size, rank): each sequence cut to this CP rank's two chunks."""

    def __init__(self, endings: List[Ending], count: int, micro_batch_size: int, length: int,
                 device: torch.device, cp: Tuple[int, int] = (1, 0)):
        self.endings, self.count, self.mb = endings, count, micro_batch_size
        self.length, self.device, self.cp = length, device, cp

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        x = np.zeros((self.mb, self.length), dtype=np.int64)
        y = np.full((self.mb, self.length), IGNORED, dtype=np.int64)
        for row, ending in enumerate(self.endings[i * self.mb:(i + 1) * self.mb]):
            x[row], y[row] = padded(ending, self.length)
        x, y = (context_shard.shard(torch.from_numpy(t), *self.cp, dim=1) for t in (x, y))
        return x.to(self.device), y.to(self.device)


class ChoiceEval:
    """Scores a ChoiceSet on this rank's model with its own forward-only pipeline schedule
    (activations of the set's padded length). Collective over the whole world."""

    def __init__(self, choices: ChoiceSet, schedule: PipelineSchedule, topo: Topology,
                 micro_batch_size: int, length: int, device: torch.device):
        self.choices, self.schedule, self.topo, self.device = choices, schedule, topo, device
        self.length = length
        n, dp = len(choices.labels), topo.dp_size
        per_rank = math.ceil(n / dp)  # examples
        first = min(topo.coords.dp_rank * per_rank, n)
        self.examples = range(first, min(first + per_rank, n))
        count = math.ceil(per_rank * len(choices.endings[0]) / micro_batch_size)
        mine = [e for i in self.examples for e in choices.endings[i]]
        self.batches = _MicroBatches(mine, count, micro_batch_size, length, device,
                                     cp=(topo.cp_size, topo.coords.cp_rank))
        self.counts = torch.tensor([[e.scored for e in ex] for ex in choices.endings])
        self.labels = torch.tensor(choices.labels)

    @torch.no_grad()
    def evaluate(self, model, engine) -> ChoiceScores:
        """Every ending's loss on every rank (the model's current weights; eval mode)."""
        model.eval()
        k = len(self.choices.endings[0])
        losses = torch.zeros(len(self.choices.labels) * k, dtype=torch.float64,
                             device=self.device)
        mine = self.schedule.sequence_losses(self.batches, self.device)
        engine.release_params()
        if mine is not None:
            lo, hi = self.examples.start * k, self.examples.stop * k
            losses[lo:hi] = mine[:hi - lo]
        comm.all_reduce(losses, self.topo.pp_group)
        comm.all_reduce(losses, self.topo.cp_group)  # each CP rank's tokens' part
        comm.all_reduce(losses, self.topo.dp_group)
        return ChoiceScores(losses.view(-1, k).cpu(), self.counts, self.labels)
