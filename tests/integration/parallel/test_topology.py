"""Rank grid: [TP, CP, PP, DP] mapping, group membership, and the real groups on gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import RankFailure, run_ranks


def _groups_on_ranks(rank, world, tp, cp, pp, dp):
    topo = build_topology(tp, pp, dp, cp=cp)
    out = {}
    for kind in ("tp", "cp", "pp", "dp", "mp") + (("dp_cp",) if cp > 1 else ()):
        g = topo.groups[kind]
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, g)
        out[kind] = (g.ranks, t.item())
    return out, topo.counter.snapshot()


@pytest.mark.distributed
@pytest.mark.parametrize("tp,cp,pp,dp", [(2, 1, 2, 2), (1, 1, 2, 2), (1, 2, 1, 2)])
def test_real_groups_reduce_over_their_members(tp, cp, pp, dp):
    results = run_ranks(_groups_on_ranks, tp * cp * pp * dp, args=(tp, cp, pp, dp))
    for rank, (groups, counts) in enumerate(results):
        for kind, (ranks, total) in groups.items():
            assert rank in ranks
            assert total == sum(ranks), (rank, kind)
        # one 4-byte fp32 all-reduce per group of size > 1, counted with its ring cost
        for kind, (ranks, _) in groups.items():
            n = len(ranks)
            key = f"{kind}/all_reduce"
            if n == 1:
                assert key not in counts
            else:
                assert counts[key] == {"calls": 1, "bytes": 4, "wire_bytes": 2 * (n - 1) / n * 4}


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("planted failure")
    dist.barrier()


@pytest.mark.distributed
def test_launcher_surfaces_a_rank_failure():
    with pytest.raises(RankFailure, match="planted failure"):
        run_ranks(_fails_on_rank_one, 2, timeout_s=30)
