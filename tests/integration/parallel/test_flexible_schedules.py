"""The schedules of the large runs against the serial run (fp32, dropout 0, rel 1e-5: losses,
grad norms, validation loss, every parameter after every step), each under the collective
order probe (`megalite.testing.collective_order`): interleaved 1F1B with m not a multiple of
pp (Llama 3's flexible schedule: groups of pp micro-batches, the last one taking the rest),
uneven stages (`parallel.edge_stage_layers`) under it, at pp 2 and pp 3, and ZeRO 1-3's
data-parallel collectives overlapped with it at dp 2."""
from __future__ import annotations

import pytest

from megalite.parallel.schedule import largest_group
from megalite.testing.collective_order import order_mismatches
from tests.conftest import pipeline_layout
from tests.layouts import Prepared, assert_equal, train_in_process, train_layouts

STEPS = 4
V2 = "parallel.virtual_stages=2"


def _held(serial: dict, ranks: list, pp: int, m: int) -> None:
    """Equal to the serial run, activations within the warmup + 1 (v = 2: the largest
    group's (pp - s - 1)·2 + g + 1), and every two ranks' shared launches in one order."""
    assert_equal(serial, ranks)
    for res in ranks:
        stage = res["coords"][1]
        limit = (pp - stage - 1) * 2 + largest_group(pp, m) + 1
        assert max(res["in_flight"]) <= limit, (stage, res["in_flight"])
    problems = order_mismatches([res["launched"] for res in ranks])
    assert all(res["launched"] for res in ranks) and not problems, problems


def _blocks(ranks: list) -> dict:
    """Per pipeline stage, the transformer blocks it holds."""
    return {r["coords"][1]: sorted(int(s.name.split(".")[2]) for s in r["specs"].values()
                                   if s.name.startswith("transformer.h.")
                                   and s.name.endswith("ln_1.weight")) for r in ranks}


@pytest.mark.distributed
def test_interleaved_any_m_and_uneven_stages_equal_serial(tiny_data, tmp_path):
    """One launch of 2 ranks: pp2 v2 with m = 3 and m = 5 (groups 3 and 2 + 3), and with
    6 blocks cut 1-2-2-1 by edge_stage_layers=1 (stage 0: blocks 0, 3, 4; stage 1: 1, 2, 5);
    one of 3 ranks: pp3 v2, m = 4, 8 blocks cut 1-2-2-1-1-1 (the pp3 refusal of m = 4 before:
    not a multiple of pp)."""
    six, eight = ["model.n_layer=6", "parallel.edge_stage_layers=1"], \
        ["model.n_layer=8", "parallel.edge_stage_layers=1"]
    cases = [(3, []), (5, []), (3, six)]
    serial = [train_in_process(tmp_path / f"serial{i}", pipeline_layout(tiny_data, 1, 1, m, [
        x for x in extra if "edge" not in x]), STEPS) for i, (m, extra) in enumerate(cases)]
    runs = train_layouts(tmp_path / "pp2", 2, [pipeline_layout(tiny_data, 2, 1, m, [V2, *extra])
                                               for m, extra in cases], STEPS, probe=True)
    for reference, ranks, (m, _) in zip(serial, runs, cases):
        _held(reference, ranks, 2, m)
    assert _blocks(runs[2]) == {0: [0, 3, 4], 1: [1, 2, 5]}

    reference = train_in_process(tmp_path / "serial8", pipeline_layout(
        tiny_data, 1, 1, 4, eight[:1]), STEPS)
    (ranks,) = train_layouts(tmp_path / "pp3", 3, [pipeline_layout(tiny_data, 3, 1, 4,
                                                                   [V2, *eight])],
                             STEPS, probe=True)
    _held(reference, ranks, 3, 4)
    assert _blocks(ranks) == {0: [0, 5], 1: [1, 2, 6], 2: [3, 4, 7]}


def _first(launched: list, group: str, op: str) -> int:
    return next(i for i, x in enumerate(launched) if x[0] == group and x[2] == op)


def _exposed_gathers(trainer):
    """Count, per training step, the ZeRO-3 gathers no prefetch launched (`exposed_gathers`)."""
    zero3, per_step, step = trainer.engine.zero3, [], trainer.train_step

    def counted():
        before = zero3.exposed_gathers
        out = step()
        per_step.append(zero3.exposed_gathers - before)
        return out
    trainer.train_step = counted
    return lambda: per_step


@pytest.mark.distributed
def test_zero_overlaps_the_flexible_pipeline(tiny_data, tmp_path):
    """pp2 v2 dp2 (one launch of 4 ranks), 3 micro-batches a DP rank: ZeRO 1 with
    overlap_param_gather, ZeRO 2 on 6 blocks cut 1-2-2-1, ZeRO 3 with 5 micro-batches — each
    equal to the serial run under the order probe. ZeRO 1 reduces a chunk's buckets once the
    chunk's last micro-batch's backward is done: on stage 0 the later chunk's reduce-scatters
    launch before the step's last pipeline transfer (overlapping the earlier chunk's last
    backwards), and the gathers of the updated parameters launch in the step, before the next
    forward's first transfer (that each block then waits only for its own buckets is
    test_zero.py's test_overlapped_parameter_gather_equals_serial).

    ZeRO 3 also under 1F1B (with offload.optimizer: the prefetch after a unit's forward) and
    ZB-H1 (with recompute; B keeps its units to W): each pipeline operation prefetches the
    next one's first unit, so a step gathers one unit where it is needed (its first), not
    one per operation."""
    cases = [(3, ["zero=1", "parallel.overlap_param_gather=true", V2], []),
             (3, ["zero=2", V2], ["model.n_layer=6", "parallel.edge_stage_layers=1"]),
             (5, ["zero=3", V2], []),
             (3, ["zero=3", "offload.optimizer=0.5"], []),
             (5, ["zero=3", "parallel.schedule=zb-h1", "train.recompute=true"], [])]
    serial = [train_in_process(tmp_path / f"serial{i}", pipeline_layout(
        tiny_data, 1, 1, 2 * m, [x for x in shape if "edge" not in x]), STEPS)
        for i, (m, _, shape) in enumerate(cases[:3])]
    serial += serial[0], serial[2]  # the same serial runs (6 and 10 micro-batches)
    runs = train_layouts(tmp_path / "dp2", 4, [Prepared(pipeline_layout(
        tiny_data, 2, 1, 2 * m, ["parallel.bucket_mb=0.01", *zero, *shape]), _exposed_gathers)
        if "zero=3" in zero else pipeline_layout(
        tiny_data, 2, 1, 2 * m, ["parallel.bucket_mb=0.01", *zero, *shape])
        for m, zero, shape in cases], STEPS, probe=True)
    for reference, ranks, (m, _, _) in zip(serial, runs, cases):
        _held(reference, ranks, 2, m)
    for ranks in runs[2:]:
        assert all(r["extra"] == [1] * STEPS for r in ranks), [r["extra"] for r in ranks]
    stage0 = next(r for r in runs[0] if r["coords"] == (0, 0, 0))["launched"]
    end = _first(stage0, "embedding", "all_reduce")  # the step's gradient sums begin
    last_transfer = max(i for i, x in enumerate(stage0[:end]) if x[0] == "pp")
    assert _first(stage0, "dp", "reduce_scatter") < last_transfer
    gathers = _first(stage0, "dp", "all_gather")
    assert end < gathers < _first(stage0[end:], "pp", "send/recv") + end
