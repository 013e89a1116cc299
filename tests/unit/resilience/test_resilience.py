"""Faults that do not crash (megalite.resilience): a flipped bit in one replica is found by the
replica check and stops the run before its checkpoint; a rank slowed down is named by the
straggler report; bad `resilience.*` values are refused before launch."""
from __future__ import annotations

import time

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.schema import check_sections, load_config
from megalite.parallel.group import CollectiveWaits
from megalite.parallel.topology import Topology
from megalite.resilience.replicas import (
    TP_CHUNK,
    chunks_of,
    disagreements,
    fingerprint,
    odd_members,
    odd_within,
    sums_and_norms,
)
from megalite.resilience.stragglers import find_slow, peer_groups
from megalite.train.timers import StepTimers
from megalite.utils.clock import DeviceClock


@pytest.mark.parametrize("key, value", [
    ("resilience.check_every", -1), ("resilience.straggler_report_every", -5),
    ("resilience.straggler_factor", 1.0), ("resilience.straggler_factor", 0.5),
    ("resilience.straggler_min_s", -0.1), ("resilience.tp_rtol", -1e-3),
    ("resilience.tp_rtol", 1.0)])
def test_bad_resilience_values_are_refused_naming_the_key(key, value):
    cfg = load_config([f"{key}={value}"])
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(cfg)


def test_resilience_defaults_are_valid_and_zero_turns_them_off():
    for overrides in ([], ["resilience.check_every=0", "resilience.straggler_report_every=0",
                           "resilience.straggler_min_s=0"]):
        check_sections(load_config(overrides))


def test_fingerprints_are_exact_and_see_one_flipped_bit():
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[123] ^= 1  # the lowest mantissa bit
    assert not torch.equal(fingerprint([x], x.device), fingerprint([y], x.device))
    assert torch.equal(fingerprint([x, x.bfloat16()], x.device),
                       fingerprint([x.clone(), x.bfloat16().clone()], x.device))
    assert fingerprint([x.flip(0)], x.device) == fingerprint([x], x.device)  # no order


def test_the_odd_replica_is_named_by_majority_or_all_are():
    assert odd_members([5, 5, 7, 5]) == [2]
    assert odd_members([5, 7]) == [0, 1]  # two replicas: either may be wrong
    assert odd_members([1, 2, 3]) == [0, 1, 2]
    lines = disagreements("dp", [0, 4, 8], ["a", "b", "c"], [[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    assert lines == ["dp replicas on global ranks [0, 4, 8] differ in b (suspect rank 8)"]
    assert disagreements("tp", [0, 1], ["a"], [[1], [1]]) == []


def test_tp_replicas_without_sp_agree_within_the_tolerance_and_corruption_does_not():
    """The tolerance path (TP replicas without SP): a rounding-level drift between two
    replicas passes where the bitwise check would fail; a flipped high exponent bit, a sign
    flip of a large element and a NaN are found, naming the odd replica of three."""
    torch.manual_seed(0)
    x = torch.randn(768)
    drift = x * (1 + 1e-6 * torch.randn(768))
    big = x.abs().argmax()

    def table(*replicas):
        return [[sums_and_norms([t], x.device)[0].tolist()] for t in replicas]

    def corrupt(change):
        y = x.clone()
        change(y)
        return y

    assert disagreements("tp", [0, 1], ["ln"], table(x, drift), rtol=1e-3) == []
    bitwise = [[int(fingerprint([t], x.device)[0])] for t in (x, drift)]
    assert disagreements("tp", [0, 1], ["ln"], bitwise) != []  # what tp_rtol=0 would say
    exponent = corrupt(lambda y: y.view(torch.int32)[7].bitwise_xor_(1 << 30))
    sign = corrupt(lambda y: y[big].neg_())
    nan = corrupt(lambda y: y[3].fill_(float("nan")))
    for bad in (exponent, sign, nan):
        assert disagreements("tp", [0, 1], ["ln"], table(x, bad), rtol=1e-3) == [
            "tp (within resilience.tp_rtol=0.001) replicas on global ranks [0, 1] differ in "
            "ln (suspect ranks 0, 1)"]
        rows = table(x, drift, bad, x)
        assert odd_within([r[0][0] for r in rows], [r[0][1] for r in rows], 1e-3) == [2]
    low = corrupt(lambda y: y.view(torch.int32)[7].bitwise_xor_(1))  # below the tolerance
    assert disagreements("tp", [0, 1], ["ln"], table(x, low), rtol=1e-3) == []


def test_one_changed_element_of_a_large_tp_replica_is_found_in_its_chunk():
    """A wpe-sized tensor (1024 x 768): a flipped exponent bit that scales one element by 16
    is diluted below tp_rtol in a sum over the whole tensor, but not in the sums of its
    4096-element chunks (as `ReplicaCheck.check` compares them); a rounding-level drift of
    every element (as between replicas computed with different kernels) passes."""
    torch.manual_seed(0)
    x = torch.randn(1024 * 768) * 0.02
    x[5000] = 0.02  # exponent 121: bit 25 (the exponent's 4) is clear, flipping it is x16
    bad = x.clone()
    bad.view(torch.int32)[5000].bitwise_xor_(1 << 25)
    assert bad[5000].item() == pytest.approx(0.32)
    drift = x * (1 + 2e-3 * torch.randn(x.numel()))

    def lines(other, chunk=TP_CHUNK):
        table = [sums_and_norms([t], x.device, chunk).tolist() for t in (x, other, x)]
        names = ["wpe"] * (x.numel() // chunk)
        return disagreements("tp", [0, 1, 2], names, table, rtol=1e-3)

    assert chunks_of(x) == 192 and len(sums_and_norms([x, x[:10]], x.device)) == 193
    assert lines(bad) == ["tp (within resilience.tp_rtol=0.001) replicas on global ranks "
                          "[0, 1, 2] differ in wpe (suspect rank 1)"]
    assert lines(bad, chunk=x.numel()) == []  # one sum over the tensor: missed
    assert lines(drift) == []


def test_stragglers_need_both_the_factor_and_the_floor():
    compute = [[0.10], [0.12], [0.50], [0.14], [0.0], [0.05]]
    assert find_slow(compute, [[0, 1, 2, 3]], 1.5, 0.1) == [(2, 0, 0.50, 0.12)]
    assert find_slow(compute, [[0, 1, 2, 3]], 1.5, 0.5) == []  # below the floor
    assert find_slow(compute, [[0, 1, 3]], 1.1, 0.0) == [(3, 0, 0.14, 0.12)]
    assert find_slow(compute, [[4, 5]], 1.5, 0.04) == [(5, 0, 0.05, 0.0)]
    assert find_slow([[0.0], [0.0]], [[0, 1]], 1.5, 0.0) == []  # equal is not slower


def test_peers_are_the_ranks_of_a_pipeline_stage():
    assert peer_groups(Topology(2, 2, 2, 0)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert peer_groups(Topology(1, 4, 1, 0)) == []  # one rank per stage: no peers
    assert peer_groups(Topology(1, 1, 3, 0)) == [[0, 1, 2]]


def test_compute_time_leaves_out_the_waits_in_collectives():
    clock = DeviceClock(torch.device("cpu"))
    waits = CollectiveWaits(clock)
    timers = StepTimers(torch.device("cpu"), waits)
    with timers.phase("grad_sync"):
        waits.timed(lambda: time.sleep(0.05))
        time.sleep(0.02)
    waits.timed(lambda: time.sleep(0.03))  # outside the phases: dropped
    compute, spent = timers.take_compute(), timers.take()
    assert spent["grad_sync"] >= 0.07
    assert 0.02 <= compute["grad_sync"] < 0.05, compute
    assert waits.calls == 2 and timers.take()["grad_sync"] == 0.0
