"""The offload benchmark's bookkeeping (megalite_bench/offload.py): one variant alive at a
time in an order that rebuilds the baseline, ratios against the baselines around each
variant, waits taken from the trainer's step timers."""
from __future__ import annotations

import time

import pytest
import torch

from megalite.train.metrics import Peak
from megalite.train.timers import StepTimers
from megalite_bench.offload import time_variant, with_ratios
from megalite_bench.offload_variants import build_order, parse_variants


def test_the_baseline_is_rebuilt_between_variants():
    cuda = parse_variants(None, cuda=True)
    assert len(cuda) == 6 and parse_variants(None, cuda=False) == [
        (0.0, False, None), (0.5, False, None), (1.0, False, None)]
    names = [v[0] for v in build_order(cuda, 2)]
    base = "optimizer=0"
    assert names == [base, "optimizer=0.5", "optimizer=1", base, "optimizer=0 activations",
                     "optimizer=0.5 activations", base, "optimizer=1 activations", base]
    assert [v[0] for v in build_order(parse_variants(["1", "0:act", "0:act:6"], True), 1)] \
        == [base, "optimizer=1", base, "optimizer=0 activations", base,
            "optimizer=0 activations(first 6)", base]
    for bad in ("2", "0:act:0", "0::3", "0:act:x"):
        with pytest.raises(SystemExit, match="F:act:K"):
            parse_variants([bad], True)


def test_variant_names_parse_back_and_the_planned_variant_is_the_planners():
    """The GPU report reads a variant's offloads back from its name; the planned variant is
    the fewest first blocks under which the plan fits the device (gpt2-xl, micro-batch 8 x
    4: its plan needs 46.5 GiB, 44 GiB takes 9 blocks)."""
    from megalite_bench.gpu_parts import variant_of
    from megalite_bench.offload_variants import planned_activation_layers, variant_name

    for v in [(0.5, False, None), (0.0, True, None), (1.0, True, 6)]:
        assert variant_of(variant_name(*v)) == v
    assert variant_of("torchao CPUOffloadOptimizer") == (None, False, None)
    assert planned_activation_layers(["model=gpt2-xl"], 1024, 8, 4, 44) == 9
    with pytest.raises(SystemExit, match="no activation offload fits"):
        planned_activation_layers(["model=gpt2-xl"], 1024, 8, 4, 10)


def test_ratios_are_against_the_baselines_around_and_drift_shows():
    rows = [{"order": 0, "variant": "optimizer=0", "step_s": 1.0, "cpu_s": 0.5},
            {"order": 1, "variant": "optimizer=1", "step_s": 3.0, "cpu_s": 1.2},
            {"order": 2, "variant": "optimizer=0", "step_s": 2.0, "cpu_s": 0.7},
            {"order": 3, "variant": "optimizer=0.5", "error": "out of memory"}]
    out = with_ratios(rows, 4, 2, 1000, None, 8, Peak(None, "test"))
    assert out[1]["ratio"] == pytest.approx(3.0 / 1.5)  # the mean of 1.0 before, 2.0 after
    assert out[1]["cpu_ratio"] == pytest.approx(1.2 / 0.6)  # CPU seconds alike
    assert out[0]["ratio"] == 1.0 and out[2]["ratio"] == 1.0
    assert all(r["baseline_spread"] == 2.0 for r in out)
    assert "ratio" not in out[3] and out[3]["error"] == "out of memory"


def test_one_variant_is_built_timed_and_its_waits_counted():
    """`time_variant` warms up, resets the step timers, and reports the `offload_wait` phase
    per timed step (on CUDA those marks are CUDA events: the device's stalls count)."""
    built = []

    def make():
        timers = StepTimers(torch.device("cpu"))

        def step():
            with timers.phase("offload_wait"):
                time.sleep(0.01)
        built.append(step)
        return step, timers
    got = time_variant(make, torch.device("cpu"), warmup=2, steps=3)
    assert len(built) == 1 and len(got["times_s"]) == 3
    assert 0.01 <= got["offload_wait_s"] <= got["step_s"] * 1.5
    assert 0 <= got["cpu_s"] < 0.01  # asleep: the process spent next to no CPU
