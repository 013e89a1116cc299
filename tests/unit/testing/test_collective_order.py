"""The collective-order check itself (megalite.testing.collective_order): what it must call a
hang under NCCL's rule and what it must let pass."""
from __future__ import annotations

from megalite.testing.collective_order import order_cycle, order_mismatches

G01, G02, G12 = ("g01", (0, 1)), ("g02", (0, 2)), ("g12", (1, 2))


def _c(group, op="all_reduce"):
    return (group[0], group[1], op, None)


def test_two_ranks_in_two_groups_in_opposite_orders_are_a_mismatch():
    both, other = ("dp_cp", (0, 1)), ("cp", (0, 1))
    problems = order_mismatches([[_c(both, "all_gather"), _c(other, "all_gather")],
                                 [_c(other, "all_gather"), _c(both, "all_gather")]])
    assert problems and "ranks 0 and 1" in " ".join(problems)


def test_a_cycle_over_three_ranks_is_found_though_every_two_agree():
    cycle = [[_c(G02), _c(G01)], [_c(G01), _c(G12)], [_c(G12), _c(G02)]]
    assert order_cycle(cycle) and order_mismatches(cycle)
    assert order_mismatches(cycle)[0].startswith("a cycle")


def test_one_order_passes_with_point_to_point_batches_of_several_peers():
    pp = ("pp", (0, 1, 2))
    fine = [[_c(G02), _c(G01), ("pp", pp[1], "send/recv", (1,))],
            [_c(G01), ("pp", pp[1], "send/recv", (0, 2)), _c(G12)],
            [_c(G02), ("pp", pp[1], "send/recv", (1,)), _c(G12)]]
    assert order_cycle(fine) == [] and order_mismatches(fine) == []
