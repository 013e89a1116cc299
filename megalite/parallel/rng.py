"""Dropout randomness under tensor parallelism (Megatron's RNG tracker, Shoeybi et al. 2019 §3).

Two streams per rank, both derived from the run's seed:

- the *replicated* stream (the device's default generator): the same on every TP rank of a
  model replica, so dropout on TP-replicated activations (the residual stream without sequence
  parallelism) draws identical masks and the replicas stay identical;
- the *TP* stream: different on every TP rank, for dropout on TP-sharded activations (attention
  probabilities of this rank's heads; with sequence parallelism, this rank's sequence chunk).

`tp_region()` swaps the TP stream into the default generator for the duration of a block (SDPA
and F.dropout draw from the default generator and take no generator argument) and swaps it back
out, so each stream advances only when used. Both streams differ across data-parallel replicas
(different data) and pipeline stages (different layers). Weight initialisation does not use
these streams at all (see `megalite.model.init`), so it is the same in every layout.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def stream_seeds(seed: int, tp_rank: int, pp_rank: int, dp_rank: int) -> Dict[str, int]:
    replicated = seed + 100 * pp_rank + 7919 * (dp_rank + 1)
    return {"replicated": replicated, "tp": replicated + 2718 * (tp_rank + 1)}


def seeded_state(seed: int, device: torch.device) -> torch.Tensor:
    """The generator state that `manual_seed(seed)` gives on this device type."""
    g = torch.Generator(device) if device.type == "cuda" else torch.Generator()
    g.manual_seed(seed)
    return g.get_state()


class RNGTracker:
    def __init__(self, seed: int, tp_rank: int, pp_rank: int, dp_rank: int,
                 device: torch.device):
        self.device = device
        self.ranks = (tp_rank, pp_rank, dp_rank)
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart both streams from `seed` (and this rank's coordinates)."""
        seeds = stream_seeds(seed, *self.ranks)
        _set_state(seeded_state(seeds["replicated"], self.device), self.device)
        self._tp_state = seeded_state(seeds["tp"], self.device)

    @contextlib.contextmanager
    def tp_region(self):
        """Draw from the TP stream inside the block."""
        outside = _get_state(self.device)
        _set_state(self._tp_state, self.device)
        try:
            yield
        finally:
            self._tp_state = _get_state(self.device)
            _set_state(outside, self.device)

    def tp_state(self) -> torch.Tensor:
        return self._tp_state.clone()

    def set_tp_state(self, state: torch.Tensor) -> None:
        self._tp_state = state.clone()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"replicated": _get_state(self.device), "tp": self._tp_state.clone()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        _set_state(state["replicated"], self.device)
        self._tp_state = state["tp"].clone()
