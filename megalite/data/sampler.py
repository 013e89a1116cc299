"""Which windows a step reads: a deterministic, resumable order of samples, sliced over DP ranks.

The sampler's whole state is the number of samples consumed (and the name of its sample order):
position p of the run reads window `order.windows(p)` (`megalite.data.order`: every window once
per epoch of n positions, a fresh order each epoch, from the seed). A global batch is the next
`global_batch_size` positions; DP rank d takes the d-th contiguous slice, so concatenating the
ranks' slices gives the serial batch, and every TP/PP rank of one replica (same d) reads the
identical batch. New runs count in "bijection-v1" (O(1) memory); a position checkpointed in
"permutation-v1" (every checkpoint since orders were named, before the bijection; older ones
have no order name, read as the same) continues
in that order, where it stopped.

A *blend* of several data directories (`data.blend`, Megatron's weighted `--data-path`) fills
each position of the run from the dataset furthest behind its share (Megatron's greedy
blending: argmax_d w_d·(n + 1) − c_d after n positions, c_d the samples taken from d so far);
dataset d's c-th sample is window `order_d.windows(c)` of its own order (seeded by
seed + 1_000_003·d). The sampler's state is then the consumed count plus every c_d.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from megalite.data.errors import DataError, too_few_train_samples
from megalite.data.order import NEW_RUN_ORDER, ORDERS, check_order, make_order

__all__ = ["ORDERS", "BlendedSampler", "ResumableSampler", "blend_choices", "check_order"]

BLEND_SEED_STRIDE = 1_000_003  # dataset d of a blend draws its order from seed + stride * d


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


def _check_dp(global_batch_size: int, dp_size: int) -> None:
    if global_batch_size % dp_size != 0:
        raise DataError(f"train.global_batch_size={global_batch_size}: must be a multiple of "
                        f"the data-parallel size {dp_size}")


class ResumableSampler:
    """Deterministic sample order whose state is `consumed_samples` (see the module docstring).
    `order` names the sample order of a new run; a loaded state brings its own."""

    def __init__(self, num_samples: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, consumed_samples: int = 0, order: str = NEW_RUN_ORDER):
        _check_dp(global_batch_size, dp_size)
        if num_samples < global_batch_size:
            raise DataError(too_few_train_samples(global_batch_size, num_samples))
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed_samples = consumed_samples
        self.order = make_order(order, num_samples, seed)

    def next_global_batch(self, batch_size: Optional[int] = None) -> np.ndarray:
        """This DP rank's slice of the next global batch (sample indices) of `batch_size`
        samples (default: global_batch_size); advances the state."""
        batch_size = batch_size or self.global_batch_size
        per_rank = batch_size // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        out = self.order.windows(np.arange(first, first + per_rank, dtype=np.int64))
        self.consumed_samples += batch_size
        return out

    def next_windows(self, batch_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """This rank's slice of the next global batch: (dataset, window) arrays."""
        windows = self.next_global_batch(batch_size)
        return np.zeros(len(windows), dtype=np.int64), windows

    def next_samples(self, batch_size: Optional[int] = None) -> List[Tuple[int, int]]:
        """This rank's slice of the next global batch as (dataset, window) pairs."""
        return [(0, int(i)) for i in self.next_global_batch(batch_size)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "order": self.order.name}

    def load_state_dict(self, state: dict) -> None:
        name = check_order(state)
        if name != self.order.name:
            self.order = make_order(name, self.num_samples, self.seed)
        self.consumed_samples = int(state["consumed_samples"])


class BlendedSampler:
    """The sampler of a blend (see the module docstring): same slicing over DP ranks as
    `ResumableSampler`, positions drawn from the datasets by their weights, each dataset in its
    own sample order."""

    def __init__(self, num_samples: Sequence[int], weights: Sequence[float],
                 global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 order: str = NEW_RUN_ORDER):
        _check_dp(global_batch_size, dp_size)
        self.weights, self.num_samples, self.seed = list(weights), list(num_samples), seed
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.orders = self._orders(order)
        self.counts = [0] * len(self.orders)
        self.consumed_samples = 0

    def _orders(self, name: str) -> list:
        return [make_order(name, n, self.seed + BLEND_SEED_STRIDE * d)
                for d, n in enumerate(self.num_samples)]

    def next_windows(self, batch_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """This rank's slice of the next global batch: (dataset, window) arrays. Every rank
        draws the whole batch's datasets (the blend's counts advance alike everywhere) and
        looks up the windows of its own slice only."""
        batch_size = batch_size or self.global_batch_size
        start = list(self.counts)
        choices = np.array(blend_choices(self.weights, self.counts, batch_size), dtype=np.int64)
        self.consumed_samples += batch_size
        per_rank = batch_size // self.dp_size
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        windows = np.empty(per_rank, dtype=np.int64)
        for d, order in enumerate(self.orders):
            is_d = choices == d
            sel = is_d[mine]
            if sel.any():  # the c-th sample of dataset d, c counted from the run's start
                windows[sel] = order.windows(start[d] + np.cumsum(is_d)[mine][sel] - 1)
        return choices[mine], windows

    def next_samples(self, batch_size: Optional[int] = None) -> List[Tuple[int, int]]:
        datasets, windows = self.next_windows(batch_size)
        return list(zip(datasets.tolist(), windows.tolist()))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "counts": list(self.counts),
                "order": self.orders[0].name}

    def load_state_dict(self, state: dict) -> None:
        name = check_order(state)
        if len(state.get("counts", [])) != len(self.counts):
            raise DataError(f"the checkpoint's data position is for {len(state.get('counts', []))}"
                            f" blended datasets, this run blends {len(self.counts)}; resume with "
                            "the same data.blend, or start a new run")
        if name != self.orders[0].name:
            self.orders = self._orders(name)
        self.consumed_samples = int(state["consumed_samples"])
        self.counts = [int(c) for c in state["counts"]]
