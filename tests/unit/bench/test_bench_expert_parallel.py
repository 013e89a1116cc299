"""`megalite-bench ep`'s pieces that need no ranks: its arms, its table (ratios against ep 1
and against the plan, allgather over alltoall, whether the peak falls with ep) and the
anchors' import report."""
from __future__ import annotations

import argparse

import pytest

from megalite_bench.expert_parallel import (
    add_arguments,
    anchor_layers,
    anchor_lines,
    arms,
    run,
    table,
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


def test_anchor_report_names_each_anchor_with_its_import_result():
    anchors = anchor_layers()
    assert [a["name"] for a in anchors] == ["DeepSpeed-MoE", "megatron-core"]
    for a, line in zip(anchors, anchor_lines(anchors)):
        assert a["module"] in line
        assert (a["error"] is None) or (a["error"] in line and "does not run here" in line)


@pytest.mark.parametrize("argv", [["--ep", "2", "4"], ["--ep", "1", "3", "--world", "4"]])
def test_ep_sizes_that_do_not_start_at_1_or_divide_the_world_are_refused(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="start at 1 .* and divide --world"):
        run(parser.parse_args(argv))
