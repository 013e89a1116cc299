"""Sample orders: which window of a dataset position p of the run reads, every window once per
epoch (epoch e = p // n, n windows), a fresh order each epoch, deterministic from the seed.

Two orders, named in the sampler's checkpointed state (`ORDERS`):

* ``"bijection-v1"`` (new runs): window = π_{seed,e}(p mod n), π a keyed pseudo-random
  bijection of [0, n) evaluated per position — O(1) memory, nothing built at an epoch start.
  π is a balanced Feistel network on the b-bit integers (2^b ≥ n > 2^(b-1)), `ROUNDS` rounds,
  restricted to [0, n) by cycle walking: x -> F(x) -> F(F(x)) ... until a value < n comes out.
  Each round maps the halves (L, R) (of ⌈b/2⌉ and ⌊b/2⌋ bits, swapping widths each round) to
  (R, L xor f_k(R)) — invertible whatever f_k is, so F is a bijection of [0, 2^b) — with
  f_k = splitmix64's finaliser of R xor a 64-bit round key, truncated to L's width. The round
  keys are drawn from numpy's SeedSequence of (seed, e). Walking from x < n stays on x's cycle
  of F, which returns to x, so it stops, and restricted to [0, n) it is again a bijection; as
  2^b < 2n, a step lands in [0, n) more than half the time (expected < 2 steps).
* ``"permutation-v1"`` (runs started before the bijection: their checkpoints name it, or,
  older, carry no order name): window = perm_e[p mod n], perm_e = numpy `default_rng(seed + e).permutation(n)`
  — the whole permutation (8 bytes per window) is built when a position of epoch e is first read.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from megalite.data.errors import DataError

PERMUTATION, BIJECTION = "permutation-v1", "bijection-v1"
# The orders a sampler's state may name; a state without the key was written before orders
# were named and uses the first.
ORDERS = (PERMUTATION, BIJECTION)
NEW_RUN_ORDER = BIJECTION
ROUNDS = 6  # even: the halves end at their starting widths
_U64 = np.uint64


def check_order(state: dict) -> str:
    """The order a checkpointed data position counts in, refused by name if this megalite does
    not know it."""
    order = state.get("order", ORDERS[0])
    if order not in ORDERS:
        raise DataError(f"the checkpoint's data position is in sample order {order!r}; this "
                        f"megalite knows {', '.join(ORDERS)}: resume with the megalite that "
                        "wrote it, or start a new run (init_from takes its weights)")
    return order


def make_order(name: str, num_samples: int, seed: int):
    """The sample order `name` (one of ORDERS) over `num_samples` windows."""
    if name == BIJECTION:
        return BijectionOrder(num_samples, seed)
    if name == PERMUTATION:
        return PermutationOrder(num_samples, seed)
    raise DataError(f"sample order {name!r}: unknown; one of {', '.join(ORDERS)}")


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplications wrap mod 2^64)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


class _EpochwiseOrder:
    """Positions -> windows, vectorised; positions of one call may span epochs."""

    name = ""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise DataError(f"a sample order needs at least one window, got {num_samples}")
        self.num_samples, self.seed = int(num_samples), int(seed)

    def _within_epoch(self, index: np.ndarray, epoch: int) -> np.ndarray:
        raise NotImplementedError

    def windows(self, positions) -> np.ndarray:
        """The window (int64) of each run position (int64 array, any shape)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, index = np.divmod(positions, self.num_samples)
        if positions.size == 0 or epochs.min() == epochs.max():
            e = int(epochs.flat[0]) if positions.size else 0
            return self._within_epoch(index, e).reshape(positions.shape)
        out = np.empty(positions.shape, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._within_epoch(index[sel], int(e))
        return out

    def __getitem__(self, pos: int) -> int:
        return int(self.windows(np.array([pos]))[0])


class PermutationOrder(_EpochwiseOrder):
    """window = perm_e[p mod n], perm_e = default_rng(seed + e).permutation(n), the current
    epoch's permutation kept (the order of megalite before "bijection-v1")."""

    name = PERMUTATION

    def __init__(self, num_samples: int, seed: int):
        super().__init__(num_samples, seed)
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _within_epoch(self, index: np.ndarray, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
        return self._perm[index]


class BijectionOrder(_EpochwiseOrder):
    """window = π_{seed,e}(p mod n), a cycle-walking Feistel bijection of [0, n) (module
    docstring); O(1) memory besides the positions asked for."""

    name = BIJECTION

    def __init__(self, num_samples: int, seed: int):
        super().__init__(num_samples, seed)
        bits = max(1, (self.num_samples - 1).bit_length())
        self.hi_bits, self.lo_bits = (bits + 1) // 2, bits // 2
        # (mask, width) of the left and right halves, as uint64 scalars
        self._halves = tuple((_U64((1 << w) - 1), _U64(w)) for w in (self.hi_bits, self.lo_bits))
        self._keys: Dict[int, np.ndarray] = {}

    def round_keys(self, epoch: int) -> np.ndarray:
        if epoch not in self._keys:
            if len(self._keys) > 4:
                self._keys.clear()
            seq = np.random.SeedSequence([self.seed % 2**64, epoch])
            self._keys[epoch] = seq.generate_state(ROUNDS, dtype=np.uint64)
        return self._keys[epoch]

    def feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """F on [0, 2^b): `ROUNDS` rounds (L, R) -> (R, L xor f_k(R)) (uint64 arrays)."""
        (left_mask, left_shift), (right_mask, right_shift) = self._halves
        left, right = x >> right_shift, x & right_mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & left_mask)
            (left_mask, left_shift), (right_mask, right_shift) = \
                (right_mask, right_shift), (left_mask, left_shift)
        return (left << right_shift) | right

    def _within_epoch(self, index: np.ndarray, epoch: int) -> np.ndarray:
        keys, n = self.round_keys(epoch), _U64(self.num_samples)
        out = self.feistel(index.astype(np.uint64).ravel(), keys)
        walking = np.flatnonzero(out >= n)
        while walking.size:
            stepped = self.feistel(out[walking], keys)
            out[walking] = stepped
            walking = walking[stepped >= n]
        return out.astype(np.int64).reshape(index.shape)

