"""Checkpoints at scale, shown on a few gloo ranks: the protocol's collectives run on their own
gloo group with `checkpoint.timeout_s` (a writer slower than `parallel.timeout_s` still
publishes), replicated state is written by every DP replica (zero 0: each rank's file is 1/dp),
and a resume under another layout reads and verifies about its own share of the bytes."""
from __future__ import annotations

import torch

from megalite.checkpoint.state import ProcessRNG
from megalite.parallel.rng import RNGTracker


def test_rng_state_of_another_device_type_is_not_restored():
    rng = ProcessRNG(RNGTracker(0, 0, 0, 0, torch.device("cpu")))
    state = rng.state_dict()
    assert rng.accepts(state) and state["device_type"] == "cpu"
    assert not rng.accepts({**state, "device_type": "cuda"})
    older = {k: v for k, v in state.items() if k != "device_type"}  # written before the key
    assert rng.accepts(older)
    cuda_like = {**older, "tracker": {**older["tracker"],
                                      "replicated": torch.zeros(16, dtype=torch.uint8)}}
    assert not rng.accepts(cuda_like)
