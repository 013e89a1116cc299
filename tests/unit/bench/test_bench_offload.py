"""The offload benchmark's bookkeeping (megalite_bench/offload.py): one variant alive at a
time in an order that rebuilds the baseline, ratios against the baselines around each
variant, waits taken from the trainer's step timers; the optimizer offload's timeline
(megalite/parallel/offload_timeline.py) of real steps on CPU, after a warm-up past the first
host step, and its drawing."""
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
        return step, timers, None
    got = time_variant(make, torch.device("cpu"), warmup=2, steps=3)
    assert len(built) == 1 and len(got["times_s"]) == 3 and "timeline" not in got
    assert 0.01 <= got["offload_wait_s"] <= got["step_s"] * 1.5
    assert 0 <= got["cpu_s"] < 0.01  # asleep: the process spent next to no CPU


def test_offload_steps_are_timed_past_the_first_host_step_with_their_timeline(monkeypatch):
    """A real optimizer-offload step on CPU (tiny GPT-2, offload.optimizer=1, fp32): when the
    timed steps begin, the warm-up's host step has finished and created every range's AdamW
    moments; every timed step's seconds are reported, and the timeline holds, per timed step,
    each range's gradient copy, host step and parameter copy, inside the steps' spans."""
    from megalite.config.schema import load_config
    from megalite.parallel.offload import OptimizerOffload
    from megalite_bench.offload import build_variant, random_batches
    from megalite_bench.offload_draw import draw

    seen = []
    record = OptimizerOffload.record

    def spy(self, timeline):
        if timeline is not None:  # the timed steps are about to begin
            seen.append([(r.stepped is not None and r.stepped.done(),
                          all("exp_avg" in st for st in r.optimizer.state.values())
                          and len(r.optimizer.state) == len(r.pieces)) for r in self.order])
        record(self, timeline)
    monkeypatch.setattr(OptimizerOffload, "record", spy)
    cpu = torch.device("cpu")
    mcfg = load_config(["model.n_layer=2", "model.n_embd=32", "model.n_head=2",
                        "model.vocab_size=128", "model.n_positions=16", "model.resid_pdrop=0",
                        "model.embd_pdrop=0", "model.attn_pdrop=0"]).model
    batches = random_batches(mcfg.vocab_size, 2, 16, 2, cpu)
    got = time_variant(lambda: build_variant(mcfg, cpu, torch.float32, "fp32", 2, 16, 1.0,
                                             False, batches), cpu, warmup=1, steps=2)
    (ranges,) = seen
    assert ranges and all(done and moments for done, moments in ranges)
    assert len(got["times_s"]) == 2 and got["step_s"] > 0
    spans = got["timeline"]
    steps = [s for s in spans if s["kind"] == "step"]
    assert [s["range"] for s in steps] == [0, 1]
    for kind in ("d2h", "host_step", "h2d"):
        mine = [s for s in spans if s["kind"] == kind]
        assert sorted(s["range"] for s in mine) == sorted(list(range(len(ranges))) * 2), kind
        for s in mine:  # every copy and host step within the timed steps (the last host
            assert 0 <= s["start_s"] <= s["end_s"]  # step may outlast its step's span)
            assert steps[0]["start_s"] <= s["start_s"] <= spans[-1]["end_s"]
    assert got["timeline_s"]["host_step"] > 0 and set(got["timeline_s"]) == {
        "d2h", "host_step", "h2d", "wait"}
    inside = [x for x in spans if x["start_s"] < steps[-1]["end_s"]]  # per step: of these
    for kind in ("d2h", "wait"):
        assert got["timeline_s"][kind] == pytest.approx(sum(
            x["end_s"] - x["start_s"] for x in inside if x["kind"] == kind) / 2)
    lines = draw(spans, width=40)
    assert lines[0].startswith("  seconds 0 .. ") and len(lines) == 6
    assert all("#" in line for line in lines[2:5]) and "0" in lines[1] and "1" in lines[1]


def test_the_timeline_puts_device_and_host_spans_on_one_clock():
    from megalite.parallel.offload_timeline import OffloadTimeline, totals

    timeline = OffloadTimeline(torch.device("cpu"))
    with timeline.on_host("host_step", 0):
        pass
    timeline.begin()  # forgets the span before it
    with timeline.on_device("d2h", 1):
        time.sleep(0.02)
    with timeline.on_host("host_step", 1):
        time.sleep(0.01)
    spans = timeline.take()
    assert [(s["kind"], s["range"]) for s in spans] == [("d2h", 1), ("host_step", 1)]
    assert 0 <= spans[0]["start_s"] < spans[0]["end_s"] <= spans[1]["start_s"]
    got = totals(spans)
    assert got["d2h"] >= 0.02 and got["host_step"] >= 0.01 and got["wait"] == 0
    assert timeline.take() == []
