"""The search space's shortcuts give what the long way gives: held fields leave whole grids
out, and the links of a layout's groups come from one group per residue of its first rank."""
from __future__ import annotations

import itertools

import pytest

from megalite.config.layout import Layout
from megalite.config.schema import load_config
from megalite.plan.devices import device_profile
from megalite.plan.links import group_links, send_link
from megalite.plan.space import candidate_grids


def test_a_held_field_leaves_out_the_grids_that_differ_in_it():
    cfg = load_config(["model=gpt2", "train.global_batch_size=16", "train.seq_len=256"])
    held = {"tp": 2, "recompute": True, "recompute_layers": None}
    grids = list(candidate_grids(cfg, 8, True, held))
    assert grids and all(g.base[0] == 2 and g.base[7] and g.recompute_layers is None
                         for g in grids)


def walked_crossings(tp, cp, pp, dp, per_node, order="tp-cp-pp-dp"):
    """The long way: per kind of group that spans nodes, the fewest ranks a node of such a
    group holds (1 for point-to-point kinds: one rail), from every group's every rank (rank =
    t + tp·(c + cp·(s + pp·d)), or t + tp·(c + cp·(d + dp·s)) under tp-cp-dp-pp, nodes of
    per_node consecutive ranks)."""
    def rank(t, c, s, d):
        if order == "tp-cp-dp-pp":
            return t + tp * (c + cp * (d + dp * s))
        return t + tp * (c + cp * (s + pp * d))
    groups = {"tp": {}, "cp": {}, "dp": {}}
    for t, c, s, d in itertools.product(range(tp), range(cp), range(pp), range(dp)):
        for kind, key in (("tp", (c, s, d)), ("cp", (t, s, d)), ("dp", (t, s))):
            groups[kind].setdefault(key, []).append(rank(t, c, s, d))
    kinds = {k: list(g.values()) for k, g in groups.items()}
    kinds["pp"] = [(rank(t, c, s, d), rank(t, c, s + 1, d)) for t, c, s, d in
                   itertools.product(range(tp), range(cp), range(pp - 1), range(dp))]
    kinds["embedding"] = [(rank(t, c, 0, d), rank(t, c, pp - 1, d)) for t, c, d in
                          itertools.product(range(tp), range(cp), range(dp))]
    out = {}
    for kind, gs in kinds.items():
        crossing = [[r // per_node for r in g] for g in gs
                    if len({r // per_node for r in g}) > 1]
        if crossing:
            fewest = min(min(n.count(x) for x in set(n)) for n in crossing)
            out[kind] = 1 if kind in ("pp", "embedding") else min(fewest, per_node)
    return out


@pytest.mark.parametrize("order", ["tp-cp-pp-dp", "tp-cp-dp-pp"])
@pytest.mark.parametrize("tp,cp,pp,dp,per_node", [
    (2, 2, 3, 4, 8), (8, 1, 4, 2, 8), (1, 4, 2, 3, 6), (3, 2, 2, 2, 4), (4, 2, 2, 4, 8),
    (2, 1, 8, 8, 8)])
def test_group_links_from_one_group_per_residue_equal_walking_every_rank(tp, cp, pp, dp,
                                                                         per_node, order):
    profile = device_profile("h100-80gb")
    got = group_links(Layout(tp_size=tp, cp_size=cp, pp_size=pp, dp_size=dp,
                             rank_order=order), profile, per_node)
    crossing = walked_crossings(tp, cp, pp, dp, per_node, order)
    for kind in ("tp", "cp", "dp", "pp", "embedding"):
        assert got[kind].crosses_nodes == (kind in crossing)
        if kind not in crossing:
            assert got[kind] == send_link(profile, False)
        else:
            rails = crossing[kind]
            assert got[kind].link.bus_gbps == pytest.approx(min(
                profile.intra_node.bus_gbps, rails * profile.inter_node.bus_gbps))
