"""Which windows a step reads: a deterministic, resumable order of samples, sliced over DP ranks.

The sampler's whole state is the number of samples consumed: position p of the run reads window
`perm_e[p mod n]` with `e = p // n` and `perm_e` a permutation of the n windows seeded by
`seed + e`. A global batch is the next `global_batch_size` positions; DP rank d takes the d-th
contiguous slice, so concatenating the ranks' slices gives the serial batch, and every TP/PP rank
of one replica (same d) reads the identical batch.

A *blend* of several data directories (`data.blend`, Megatron's weighted `--data-path`) fills
each position of the run from the dataset furthest behind its share (Megatron's greedy
blending: argmax_d w_d·(n + 1) − c_d after n positions, c_d the samples taken from d so far);
dataset d's c-th sample is window `perm_{d,e}[c mod n_d]` of its own epoch-wise permutations.
The sampler's state is then the consumed count plus every c_d.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from megalite.data.errors import DataError, too_few_train_samples

# The sample orders a sampler's state may name (`state_dict()["order"]`); a state without the
# key was written before orders were named and uses the first.
ORDERS = ("permutation-v1",)


def check_order(state: dict) -> None:
    """A checkpointed data position is in an order this megalite can continue."""
    order = state.get("order", ORDERS[0])
    if order not in ORDERS:
        raise DataError(f"the checkpoint's data position is in sample order {order!r}; this "
                        f"megalite knows {', '.join(ORDERS)}: resume with the megalite that "
                        "wrote it, or start a new run (init_from takes its weights)")


class SampleOrder:
    """Position p -> window `perm_e[p mod n]`, e = p // n, perm_e a permutation of the n windows
    seeded by `seed + e`: every window once per epoch, a fresh order each epoch."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def __getitem__(self, pos: int) -> int:
        epoch = pos // self.num_samples
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return int(self._perm[pos % self.num_samples])


def blend_choices(weights: Sequence[float], counts: List[int], n: int) -> List[int]:
    """The datasets of the next `n` positions (Megatron's greedy blending), advancing `counts`
    (samples taken from each dataset so far; their sum is the positions filled so far)."""
    total = sum(weights)
    shares = [w / total for w in weights]
    out = []
    filled = sum(counts)
    for i in range(n):
        d = max(range(len(shares)), key=lambda k: shares[k] * (filled + i + 1) - counts[k])
        counts[d] += 1
        out.append(d)
    return out


class ResumableSampler:
    """Deterministic sample order whose state is `consumed_samples` (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, consumed_samples: int = 0):
        if global_batch_size % dp_size != 0:
            raise DataError(f"train.global_batch_size={global_batch_size}: must be a multiple of "
                            f"the data-parallel size {dp_size}")
        if num_samples < global_batch_size:
            raise DataError(too_few_train_samples(global_batch_size, num_samples))
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed_samples = consumed_samples
        self._order = SampleOrder(num_samples, seed)

    def next_global_batch(self, batch_size: Optional[int] = None) -> np.ndarray:
        """This DP rank's slice of the next global batch (sample indices) of `batch_size`
        samples (default: global_batch_size); advances the state."""
        batch_size = batch_size or self.global_batch_size
        per_rank = batch_size // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        out = np.array([self._order[pos] for pos in range(first, first + per_rank)],
                       dtype=np.int64)
        self.consumed_samples += batch_size
        return out

    def next_samples(self, batch_size: Optional[int] = None) -> List[Tuple[int, int]]:
        """This rank's slice of the next global batch as (dataset, window) pairs."""
        return [(0, int(i)) for i in self.next_global_batch(batch_size)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "order": ORDERS[0]}

    def load_state_dict(self, state: dict) -> None:
        check_order(state)
        self.consumed_samples = int(state["consumed_samples"])


class BlendedSampler:
    """The sampler of a blend (see the module docstring): same slicing over DP ranks as
    `ResumableSampler`, positions drawn from the datasets by their weights."""

    def __init__(self, num_samples: Sequence[int], weights: Sequence[float],
                 global_batch_size: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch_size % dp_size != 0:
            raise DataError(f"train.global_batch_size={global_batch_size}: must be a multiple of "
                            f"the data-parallel size {dp_size}")
        self.weights = list(weights)
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.orders = [SampleOrder(n, seed + 1_000_003 * d) for d, n in enumerate(num_samples)]
        self.counts = [0] * len(self.orders)
        self.consumed_samples = 0

    def next_samples(self, batch_size: Optional[int] = None) -> List[Tuple[int, int]]:
        batch_size = batch_size or self.global_batch_size
        start = list(self.counts)
        choices = blend_choices(self.weights, self.counts, batch_size)
        taken = list(start)
        pairs = []
        for d in choices:
            pairs.append((d, self.orders[d][taken[d]]))
            taken[d] += 1
        self.consumed_samples += batch_size
        per_rank = batch_size // self.dp_size
        return pairs[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "counts": list(self.counts),
                "order": ORDERS[0]}

    def load_state_dict(self, state: dict) -> None:
        check_order(state)
        if len(state.get("counts", [])) != len(self.counts):
            raise DataError(f"the checkpoint's data position is for {len(state.get('counts', []))}"
                            f" blended datasets, this run blends {len(self.counts)}; resume with "
                            "the same data.blend, or start a new run")
        self.consumed_samples = int(state["consumed_samples"])
        self.counts = [int(c) for c in state["counts"]]
