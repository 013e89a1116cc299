"""The self-test's EP exchange check (`megalite-selftest`): the world's ranks regrouped as
expert parallelism folds them (`megalite.parallel.topology.build_topology(ep=...)`: ep groups
of `ep` ranks, ep the largest power of two up to `MAX_EP` that divides a node's ranks and the
world, so that the group stays inside a node where it can), and every ep group exchanging
rows as the MoE all-to-all dispatcher does (`megalite.model.moe.dispatcher`): the row counts
first (one per peer, an all-to-all of equal chunks), then rows of uneven counts (an all-to-all
with those splits, `megalite.parallel.comm.all_to_all`, the flight recorder and the hang watch
seeing it on the "ep" group). Sender s sends receiver r `rows_for(s, r)`: 1 + (s + 2r) mod 3
rows whose values encode (s, r, row, column), so that every row received can be checked
exactly (each pair sends at least one row, its count differing between pairs).

The figure is the number of rows received wrong on the worst rank (0 passes); an exchange that
raises (a timeout at `parallel.timeout_s`) fails the check, naming the rank and its ep group.
"""
from __future__ import annotations

import math
import time
from typing import List

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.topology import build_topology, group_ranks

MAX_EP = 8  # the anchors' usual EP inside a node (Mixtral 8x22B's ep 8)
WIDTH = 16  # values per row


def ep_size(world: int, per_node: int) -> int:
    """The largest power of two <= MAX_EP dividing the world and a node's ranks (the world's
    alone when a node has one rank); 1: no exchange to check."""
    ep = 1
    while (2 * ep <= MAX_EP and world % (2 * ep) == 0
           and (per_node == 1 or per_node % (2 * ep) == 0)):
        ep *= 2
    return ep


def rows_for(sender: int, receiver: int, device: torch.device) -> torch.Tensor:
    """The rows global rank `sender` sends `receiver`: 1 + (s + 2r) mod 3 rows of WIDTH values
    s·2^20 + r·2^8 + row·WIDTH + column (exact in float64)."""
    n = 1 + (sender + 2 * receiver) % 3
    idx = torch.arange(n * WIDTH, dtype=torch.float64, device=device).view(n, WIDTH)
    return sender * 2.0 ** 20 + receiver * 2.0 ** 8 + idx


def exchange(group: Group, device: torch.device) -> int:
    """One dispatcher-style exchange over `group`: counts, then the rows; the rows received
    wrong (or missing) on this rank."""
    me = group.ranks[group.rank]
    sent = [rows_for(me, peer, device) for peer in group.ranks]
    counts = torch.tensor([len(r) for r in sent], dtype=torch.int64, device=device)
    got_counts = torch.empty_like(counts)
    comm.all_to_all(got_counts, counts, group)
    splits = got_counts.tolist()
    received = torch.empty(sum(splits), WIDTH, dtype=torch.float64, device=device)
    comm.all_to_all(received, torch.cat(sent), group, splits, counts.tolist())
    wrong = 0
    for peer, piece in zip(group.ranks, received.split(splits)):
        expect = rows_for(peer, me, device)
        if piece.shape != expect.shape:
            wrong += max(len(piece), len(expect))
        else:
            wrong += int((piece != expect).any(dim=1).sum())
    return wrong


def ep_exchange_check(world: int, per_node: int, device: torch.device, timeout_s: float
                      ) -> dict:
    """The check's result (the same on every rank): passed, figure (rows wrong on the worst
    rank), quantity (what and where), the ep groups, seconds."""
    t0 = time.perf_counter()
    ep = ep_size(world, per_node)
    topo = build_topology(1, 1, world, timeout_s=timeout_s, ep=ep)
    group = topo.ep_group
    where = f"rank {topo.rank} in the ep group (global ranks {group.ranks})"
    try:
        wrong = float(exchange(group, device))
        quantity = f"{int(wrong)} rows received wrong by {where}"
    except Exception as e:  # a peer that never arrives: gloo / NCCL time out here
        wrong, quantity = math.inf, f"{type(e).__name__} on {where}: {e}"
    gathered: List[object] = [None] * world
    dist.all_gather_object(gathered, (wrong, quantity))
    wrong, quantity = max(gathered, key=lambda fq: fq[0])
    for g in topo.groups.values():
        if g.pg is not None:
            dist.destroy_process_group(g.pg)
    return {"name": f"ep{ep} exchange", "kind": "exchange", "passed": wrong == 0,
            "figure": wrong, "quantity": quantity, "ep": ep,
            "groups": group_ranks(1, 1, world, 1, ep)["ep"],
            "tolerance": 0,
            "tolerance_rule": "every row of the counts-then-rows all-to-all received exactly",
            "seconds": round(time.perf_counter() - t0, 3)}
