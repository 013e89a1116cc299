"""A collective's latency as NCCL's own model prices a ring (src/graph/tuning.cc: base +
nsteps × a step's latency; nsteps 2(n − 1) for an all-reduce, n − 1 for an all-gather or a
reduce-scatter), from the profile's 2-rank latency; and the search's bound below it."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from megalite.plan.devices import BY_NAME, Link
from megalite.plan.links import GroupLink, collective_latency, send_link
from megalite.plan.search_bounds import smallest_latency
from tests.unit.plan.test_planner import planned, synthetic

NVLINK = send_link(BY_NAME["a100-80gb"], False)  # 15 µs a 2-rank all-reduce


def test_nvlink_ring_latencies_are_nccls():
    """NCCL's Simple-protocol ring on NVLink: base 8.4 µs, 3.4 µs a step (2-rank all-reduce
    15.2 µs, the table's 15): 8 ranks' all-reduce 8.4 + 14 × 3.3 µs, not 7 × 15 µs."""
    us = {op: collective_latency(NVLINK, 8, op) * 1e6
          for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}
    assert collective_latency(NVLINK, 2) == pytest.approx(15e-6, rel=1e-12)
    assert us["all_reduce"] == pytest.approx(8.4 + 14 * 3.3, rel=1e-9)
    assert us["all_reduce"] == pytest.approx(8.4 + 14 * 3.4, rel=0.03)  # NCCL's constants
    assert us["all_gather"] == us["reduce_scatter"] == pytest.approx(8.4 + 7 * 3.3, rel=1e-9)
    assert us["send_recv"] == pytest.approx(15, rel=1e-12)  # one send: the fit's latency
    assert collective_latency(NVLINK, 1) == 0


def test_a_kinds_own_fit_is_its_2_rank_time():
    own = GroupLink(Link(100.0, 2e-5), False, {"all_gather": Link(100.0, 1.2e-5)})
    assert collective_latency(own, 2, "all_gather") == pytest.approx(1.2e-5, rel=1e-12)
    assert collective_latency(own, 5, "all_gather") == pytest.approx(
        8.4e-6 + 4 * (1.2e-5 - 8.4e-6), rel=1e-12)
    tiny = GroupLink(Link(100.0, 5e-6), False)  # under NCCL's base: the whole latency
    assert collective_latency(tiny, 64) == pytest.approx(5e-6, rel=1e-12)


def test_tp_term_grows_with_nccls_steps_not_ranks_times_the_2_rank_latency():
    """Latency only (the bytes cost nothing): tp 4 against tp 2 on the same model and batch,
    the same collectives: (8.4 + 6 × 0.8) / (8.4 + 2 × 0.8) µs each (2-rank latency 10 µs),
    where ranks − 1 times the 2-rank latency gave 3x."""
    tp = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    profile = synthetic(bus=1e9, latency=1e-5)
    _, _, two = planned(tp + ["tp=2"], 2, profile)
    _, _, four = planned(tp + ["tp=4"], 4, profile)
    assert four.terms["tp"] / two.terms["tp"] == pytest.approx(13.2 / 10.0, rel=1e-6)


def test_the_search_bound_prices_no_collective_above_its_latency():
    """`smallest_latency` × (n − 1) is no more than any collective's latency over n ranks,
    on every link and fit of the profile (the search's lower bound stays one)."""
    a100 = BY_NAME["a100-80gb"]
    fitted = replace(a100, op_links={"intra_node": {"reduce_scatter": Link(200.0, 9e-6)}})
    for profile in (a100, fitted, synthetic(latency=1e-5)):
        step = smallest_latency(profile)
        links = [send_link(profile, False), send_link(profile, True)]
        for link, n, op in itertools.product(links, (2, 3, 8, 128),
                                             ("all_reduce", "all_gather", "reduce_scatter")):
            assert step * (n - 1) <= collective_latency(link, n, op) * (1 + 1e-12)
