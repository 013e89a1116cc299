"""`megalite-bench ep`'s pieces that need no ranks: its arms, its table (ratios against ep 1
and against the plan, allgather over alltoall, whether the peak falls with ep), the layers'
table beside the anchors' (ratios against megalite's at each ep, the equality verdict) and the
anchors' report (an import's error, where a run's error was raised)."""
from __future__ import annotations

import argparse

import pytest

from megalite.config.moe import MoEConfig
from megalite.model.moe.layer import MoELayer
from megalite_bench.expert_parallel import add_arguments, arms, run, table
from megalite_bench.expert_parallel_anchors import (
    anchor_layers,
    anchor_lines,
    compare_lines,
    error_text,
)


def _row(ep, dispatch, measured, wire, tokens_per_s):
    return {"ep": ep, "dispatch": dispatch, "measured": measured * 2**20,
            "planned": 2 * measured * 2**20, "wire": wire, "wire_planned": 0.0 if ep == 1
            else 2 * wire, "tokens_per_s": tokens_per_s}


def test_arms_run_ep1_once_and_each_dispatch_above():
    assert arms([1, 2]) == [(1, "-"), (2, "alltoall"), (2, "allgather")]


def test_table_ratios_and_the_fall_with_ep():
    rows = [_row(1, "-", 100, 0, 1000), _row(2, "alltoall", 80, 4, 800),
            _row(2, "allgather", 120, 8, 400)]
    lines = table(rows)
    assert len(lines) == 1 + len(rows) + 2
    ep2 = lines[2].split()
    assert ep2[:2] == ["2", "alltoall"]
    assert ep2[4:7] == ["0.5000", "0.800", "0.800"]  # meas/plan, peak/ep1, plan/ep1
    assert ep2[8] == "0.5000" and len(ep2) == 10  # wire/plan; no ag/a2a on alltoall's row
    assert lines[3].split()[-1] == "0.500"  # allgather's tokens/s over alltoall's
    assert lines[1].split()[8] == "-"  # ep 1 plans no EP bytes
    assert lines[-2].endswith("(alltoall): yes") and lines[-1].endswith("(allgather): NO")


def test_anchor_report_names_each_anchor_with_its_import_error_or_its_run():
    anchors = anchor_layers()
    assert [a["name"] for a in anchors] == ["DeepSpeed-MoE", "megatron-core"]
    status = {a["name"]: f"ran {a['name']}" for a in anchors if a["error"] is None}
    for a, line in zip(anchors, anchor_lines(anchors, status)):
        assert a["module"] in line
        if a["error"] is None:
            assert line.endswith(f"ran {a['name']}")
        else:
            assert line.endswith(f"does not import here, not run: {a['error']}")


def test_layer_table_ratios_against_megalite_at_each_ep_and_the_verdict():
    def row(ep, layer, peak, tokens_per_s, rel):
        return {"ep": ep, "layer": layer, "peak": peak * 2**20, "tokens_per_s": tokens_per_s,
                "rel": rel}

    rows = [row(1, "megalite", 4, 1000, None), row(1, "DeepSpeed-MoE", 2, 500, 3e-7),
            row(2, "megalite", 2, 800, None), row(2, "DeepSpeed-MoE", 3, 1200, 2e-5)]
    lines = compare_lines(rows)
    assert lines[2].split() == ["1", "DeepSpeed-MoE", "2.00", "0.500", "500", "0.500", "3.0e-07"]
    assert lines[4].split()[3:6] == ["1.500", "1200", "1.500"]  # against ep 2's megalite
    assert lines[3].split()[-1] == "-"
    assert lines[-1].endswith("rel 1e-05): NO")  # 2e-5 at ep 2
    assert compare_lines(rows[:2])[-1].endswith(": yes")
    assert len(compare_lines(rows[:1])) == 2  # no anchor ran: no verdict


def test_a_run_error_names_its_innermost_frame_in_the_package():
    with pytest.raises(ValueError) as raised:  # tp 2 with tokens not split over TP
        MoELayer(MoEConfig(num_experts=4), 8, 16, 0, tp=2)
    text = error_text(raised.value, "megalite")
    assert text.startswith("ValueError: an MoE layer with tp=2 needs")
    assert " (at megalite/model/moe/layer.py:" in text and text.endswith(" in __init__)")
    assert error_text(raised.value, "deepspeed") == f"ValueError: {raised.value}"


@pytest.mark.parametrize("argv", [["--ep", "2", "4"], ["--ep", "1", "3", "--world", "4"]])
def test_ep_sizes_that_do_not_start_at_1_or_divide_the_world_are_refused(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="start at 1 .* and divide --world"):
        run(parser.parse_args(argv))
