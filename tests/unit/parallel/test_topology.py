"""Rank grid: [TP, CP, PP, DP] (and Megatron's PP-outermost order) mapping and group membership."""
import itertools

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.topology import Coords, build_topology, coords_of, group_ranks, rank_of

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 4), (2, 2, 2), (4, 2, 1), (2, 1, 3), (1, 4, 2)]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_rank_formula_round_trips(tp, pp, dp):
    for rank in range(tp * pp * dp):
        c = coords_of(rank, tp, pp)
        assert rank == c.tp_rank + tp * (c.pp_rank + pp * c.dp_rank)
        assert rank_of(c, tp, pp) == rank
        assert 0 <= c.dp_rank < dp


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_groups_partition_the_world(tp, pp, dp):
    world = tp * pp * dp
    groups = group_ranks(tp, pp, dp)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        lists = groups[kind]
        assert sorted(itertools.chain(*lists)) == list(range(world)), kind
        assert all(len(g) == size for g in lists), kind
    for g in groups["tp"]:  # TP innermost: consecutive ranks (inside one node)
        assert g == list(range(g[0], g[0] + tp))
    for g in groups["dp"]:  # members share (tp, pp) and differ in dp
        cs = [coords_of(r, tp, pp) for r in g]
        assert len({(c.tp_rank, c.pp_rank) for c in cs}) == 1 and [c.dp_rank for c in cs] == list(range(dp))
    for g in groups["embedding"]:
        stages = [coords_of(r, tp, pp).pp_rank for r in g]
        assert stages == sorted({0, pp - 1})


def test_example_layout_2_2_2():
    g = group_ranks(2, 2, 2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert coords_of(5, 2, 2) == Coords(tp_rank=1, pp_rank=0, dp_rank=1)


def test_world_size_one_needs_no_process_group():
    topo = build_topology(1, 1, 1)
    assert topo.world_size == 1 and topo.is_first_stage and topo.is_last_stage
    t = torch.ones(3)
    comm.all_reduce(t, topo.dp_group)
    assert t.tolist() == [1, 1, 1] and topo.counter.snapshot() == {}


CP_LAYOUTS = [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2), (2, 2, 2, 2), (1, 4, 1, 2),
              (2, 3, 1, 1)]


@pytest.mark.parametrize("tp,cp,pp,dp", CP_LAYOUTS)
def test_cp_rank_formula_round_trips(tp, cp, pp, dp):
    seen = set()
    for rank in range(tp * cp * pp * dp):
        c = coords_of(rank, tp, pp, cp)
        assert rank == c.tp_rank + tp * (c.cp_rank + cp * (c.pp_rank + pp * c.dp_rank))
        assert rank_of(c, tp, pp, cp) == rank
        assert 0 <= c.cp_rank < cp and 0 <= c.pp_rank < pp and 0 <= c.dp_rank < dp
        seen.add((c.tp_rank, c.cp_rank, c.pp_rank, c.dp_rank))
    assert len(seen) == tp * cp * pp * dp


@pytest.mark.parametrize("tp,cp,pp,dp", CP_LAYOUTS)
def test_cp_groups_partition_the_world(tp, cp, pp, dp):
    world = tp * cp * pp * dp
    groups = group_ranks(tp, pp, dp, cp)
    # kind -> (size, the coordinates its members share)
    kinds = {"tp": (tp, ("cp", "pp", "dp")), "cp": (cp, ("tp", "pp", "dp")),
             "pp": (pp, ("tp", "cp", "dp")), "dp": (dp, ("tp", "cp", "pp")),
             "mp": (tp * pp, ("cp", "dp")), "dp_cp": (dp * cp, ("tp", "pp"))}
    for kind, (size, shared) in kinds.items():
        lists = groups[kind]
        assert sorted(itertools.chain(*lists)) == list(range(world)), kind
        assert all(len(g) == size for g in lists), kind
        for g in lists:
            cs = [coords_of(r, tp, pp, cp) for r in g]
            assert len({tuple(getattr(c, f"{k}_rank") for k in shared) for c in cs}) == 1, kind
    for g in groups["tp"]:  # TP innermost: consecutive ranks
        assert g == list(range(g[0], g[0] + tp))
    for g in groups["embedding"]:
        assert [coords_of(r, tp, pp, cp).pp_rank for r in g] == sorted({0, pp - 1})


def test_example_layout_tp2_cp2_pp2():
    g = group_ranks(2, 2, 1, cp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert coords_of(6, 2, 2, 2) == Coords(tp_rank=0, pp_rank=1, dp_rank=0, cp_rank=1)


def test_without_cp_the_grad_group_is_the_dp_group():
    assert "dp_cp" not in group_ranks(2, 2, 2)
    topo = build_topology(1, 1, 1)
    assert topo.grad_group is topo.dp_group and topo.cp_group.size == 1
    assert "cp=0/1" in topo.describe()


ORDERS = [(2, 1, 2, 2, 2), (2, 2, 3, 2, 4), (1, 2, 2, 3, 3), (4, 1, 2, 4, 8), (2, 1, 8, 8, 8)]


@pytest.mark.parametrize("tp,cp,pp,dp,ep", ORDERS)
def test_megatron_order_places_pp_outermost_and_keeps_ep_in_a_stage_run(tp, cp, pp, dp, ep):
    """parallel.rank_order=tp-cp-dp-pp: rank = t + tp·(c + cp·(d + dp·s)), every rank once;
    each group's members share the coordinates documented in `group_ranks` and walk the
    other one in order; a stage's tp·cp·dp ranks are one run, split into EP groups of ep
    consecutive ranks. Under the default order the same groups (by coordinates) hold other
    ranks wherever pp > 1 and dp > 1."""
    order, world = "tp-cp-dp-pp", tp * cp * pp * dp
    seen = []
    for t, c, s, d in itertools.product(range(tp), range(cp), range(pp), range(dp)):
        rank = rank_of(Coords(tp_rank=t, cp_rank=c, pp_rank=s, dp_rank=d), tp, pp, cp, dp,
                       order)
        assert rank == t + tp * (c + cp * (d + dp * s))
        assert coords_of(rank, tp, pp, cp, dp, order) == Coords(t, s, d, c)
        seen.append(rank)
    assert sorted(seen) == list(range(world))
    groups = group_ranks(tp, pp, dp, cp, ep, order)
    walks = {"tp": "tp_rank", "cp": "cp_rank", "pp": "pp_rank", "dp": "dp_rank"}
    for kind, walked in walks.items():
        assert sorted(itertools.chain(*groups[kind])) == list(range(world)), kind
        for g in groups[kind]:
            cs = [coords_of(r, tp, pp, cp, dp, order) for r in g]
            fixed = {(c.tp_rank, c.cp_rank, c.pp_rank, c.dp_rank) for c in cs}
            assert [getattr(c, walked) for c in cs] == list(range(len(g))), kind
            assert len({tuple(v for f, v in vars(c).items() if f != walked)
                        for c in cs}) == 1 and len(fixed) == len(g), kind
    stage = tp * cp * dp
    for s in range(pp):
        members = [r for r in range(world) if coords_of(r, tp, pp, cp, dp, order).pp_rank == s]
        assert members == list(range(s * stage, (s + 1) * stage))
    for g in groups["ep"]:
        assert g == list(range(g[0], g[0] + ep))
    assert sorted(itertools.chain(*groups["edp"])) == list(range(world))
    if pp > 1 and dp > 1:
        assert group_ranks(tp, pp, dp, cp, ep)["pp"] != groups["pp"]


def test_rank_orders_are_named_and_megatrons_needs_the_dp_size():
    with pytest.raises(ValueError, match="tp-cp-pp-dp"):
        rank_of(Coords(0, 0, 0), 2, 2, 1, 2, "dp-pp-cp-tp")
    with pytest.raises(ValueError, match="needs the dp size"):
        coords_of(3, 2, 2, 1, None, "tp-cp-dp-pp")
