"""The self-test's EP exchange check (megalite/train/selftest_ep.py) on 2 gloo ranks: a clean
exchange passes with no row wrong; rows corrupted on one rank fail it, naming the rank and its
ep group; the text report's line."""
from __future__ import annotations

import pytest
import torch

from megalite.cli.selftest import report_text
from megalite.testing.spawn import run_ranks
from megalite.train import selftest_ep


def _checks(rank, world):
    cpu = torch.device("cpu")
    clean = selftest_ep.ep_exchange_check(world, world, cpu, timeout_s=30)
    honest = selftest_ep.rows_for
    if rank == 1:  # a faulty rank: what it sends (and expects) is off by one
        selftest_ep.rows_for = lambda s, r, d: honest(s, r, d) + 1
    try:
        corrupted = selftest_ep.ep_exchange_check(world, world, cpu, timeout_s=30)
    finally:
        selftest_ep.rows_for = honest
    return clean, corrupted


@pytest.mark.distributed
def test_the_ep_exchange_passes_clean_and_names_the_group_of_a_corrupted_rank():
    res = run_ranks(_checks, 2, timeout_s=120)
    same = [[{k: v for k, v in c.items() if k != "seconds"} for c in r] for r in res]
    assert same[0] == same[1]  # every rank reports the same result (its own time aside)
    clean, corrupted = res[0]
    assert clean["passed"] and clean["figure"] == 0 and clean["ep"] == 2, clean
    assert clean["groups"] == [[0, 1]] and clean["name"] == "ep2 exchange"
    assert not corrupted["passed"] and corrupted["figure"] > 0, corrupted
    assert "in the ep group (global ranks [0, 1])" in corrupted["quantity"], corrupted
    report = {"passed": False, "world_size": 2, "nodes": 1, "ranks_per_node": 2,
              "device": "cpu", "precision": "fp32", "torch": "2.x", "skipped": [],
              "tolerance_rule": "fp32: rel 1e-5", "seconds": 1.0,
              "checks": [clean, corrupted]}
    lines = report_text(report).splitlines()
    assert lines[2].split()[:4] == ["ep2", "exchange", "pass", "0"], lines[2]
    assert "FAIL" in lines[3] and "global ranks [0, 1]" in lines[3], lines[3]

