"""Checkpoints at scale, shown on a few gloo ranks: the protocol's collectives run on their own
gloo group with `checkpoint.timeout_s` (a writer slower than `parallel.timeout_s` still
publishes), replicated state is written by every DP replica (zero 0: each rank's file is 1/dp),
and a resume under another layout reads and verifies about its own share of the bytes."""
from __future__ import annotations

import numpy as np
import torch

from megalite.checkpoint.state import RESEED_STRIDE, ProcessRNG, Progress
from megalite.parallel.rng import RNGTracker


def test_rng_state_of_another_device_type_is_not_restored():
    rng = ProcessRNG(RNGTracker(0, 0, 0, 0, torch.device("cpu")), 0, Progress())
    state = rng.state_dict()
    assert rng.accepts(state) and state["device_type"] == "cpu"
    assert not rng.accepts({**state, "device_type": "cuda"})
    older = {k: v for k, v in state.items() if k != "device_type"}  # written before the key
    assert rng.accepts(older)
    cuda_like = {**older, "tracker": {**older["tracker"],
                                      "replicated": torch.zeros(16, dtype=torch.uint8)}}
    assert not rng.accepts(cuda_like)


def test_rng_streams_of_another_layout_or_device_restart_from_the_seed_and_the_step():
    """No state (the checkpoint's layout differs) or one of another device type: the device's
    streams restart from seed + RESEED_STRIDE * the restored step; the host generators of a
    state of another device type are restored."""
    progress = Progress(step=3)
    rng = ProcessRNG(RNGTracker(7, 0, 0, 0, torch.device("cpu")), 7, progress)
    fresh = RNGTracker(7 + RESEED_STRIDE * 3, 0, 0, 0, torch.device("cpu")).state_dict()
    torch.rand(5)  # moves the replicated stream (the CPU generator on CPU)
    rng.load_state_dict(None)
    assert all(torch.equal(v, fresh[k]) for k, v in rng.tracker.state_dict().items())
    saved = rng.state_dict()
    torch.rand(5)
    np.random.rand(5)
    rng.load_state_dict({**saved, "device_type": "cuda"})  # host restored, then reseeded
    assert all(torch.equal(v, fresh[k]) for k, v in rng.tracker.state_dict().items())
    assert (np.random.get_state()[1] == saved["numpy"][1]).all()
