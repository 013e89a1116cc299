"""Replica consistency (`resilience.check_every=N`): after the optimizer step of every N-th step,
and of every step that is checkpointed, the ranks that must hold identical values compare
checksums of them, and a difference stops the run on every rank, naming the step, the ranks
and the tensors. A GPU that computes a wrong number without an error (silent data corruption)
shows up as one replica that no longer equals the others.

What is compared, over which group (`megalite.parallel.topology`):

    dp         DP replicas: every model parameter under zero 0-2 (zero 3 shards them), and
               under zero 0 the optimizer state too (AdamW's moments, and the fp32 master
               weights where they are not the parameters themselves); with context
               parallelism the DP x CP ranks ("dp_cp", `Topology.grad_group`: the CP ranks
               of a (tp, pp, dp) hold the same parameters, reduce their gradients together
               and split ZeRO's ranges over DP x CP)
    tp         TP replicas of the parameters TP does not split (LayerNorms, the biases of
               row-parallel layers, wpe); under zero 3 their fp32 master ranges
    embedding  the tied embedding's two copies, on the first and the last pipeline stage
    edp        with expert parallelism (ep > 1) the routed experts, which only the EDP ranks
               hold alike (and, under zero 0, their optimizer state), instead of over DP

DP replicas, the tied embedding's copies and TP replicas under sequence parallelism are
compared bitwise; TP replicas without it within a tolerance (below). The checksum of a tensor
is the sum of its elements' bit patterns read as integers (int32 for fp32, int16 for
bf16/fp16), accumulated in int64: exact and order-independent, so equal tensors give equal
sums on any device, and any change of one element (one flipped bit changes the sum by
±2^k) changes it. Changes of several elements can cancel, with a probability that does not
matter for one faulty element. Each rank sends one int64 per tensor (an all_gather per
group, counted with the group's traffic).

Why bitwise holds: DP replicas apply the same all-reduced (or all-gathered) values with the
same kernels. TP replicas of replicated parameters under sequence parallelism get their
gradients summed by an all-reduce over TP (`ZeroEngine.finish_grad_sync`: every rank holds a
sequence chunk's partial gradient), which hands every rank the same bits, and the same
(globally clipped) update follows. The tied embedding's copies get the same summed gradient
and the same update.

Where it need not hold: without sequence parallelism each TP rank computes the gradients of
its replicated parameters itself, from the same (all-reduced) activations. They are bitwise
equal only if every TP rank's kernels are deterministic, which GPU kernels need not be
(atomics in a reduction): the replicas may drift apart by rounding, and a bitwise check
would raise false alarms (Megatron compares DP replicas only). There each rank sends, per
chunk of TP_CHUNK (4096) consecutive elements of each tensor, the fp64 sum of the chunk's
elements and the fp64 sum of their magnitudes (its L1 norm), and replicas differ when the sums
of a chunk differ by more than `resilience.tp_rtol` (default 1e-3) times the chunk's largest
L1 norm among them. That sees any change of an element by more than tp_rtol of its chunk's L1
norm (about 4 x the mean magnitude at 4096 x 1e-3) — a flipped high exponent bit, a
non-finite value, an element scaled by 16 by a flipped exponent bit, a sign flip of a large
element — which one sum over a tensor of 786k elements (wpe) would dilute 192-fold; but
not a flip in the low mantissa bits nor a drift within the tolerance. Rounding drift between
replicas averages out over a chunk (relative ~ ulp / sqrt(4096)). The traffic: two fp64 per
4096 elements. `resilience.tp_rtol=0` compares them bitwise too (deterministic kernels
assumed, as on CPU).

With two replicas a mismatch cannot say which one is wrong, and both ranks are named; with
three or more, the ranks that differ from the majority are.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.bucket import MOMENTS
from megalite.parallel.group import Group
from megalite.parallel.topology import Topology

# the integer type whose bit patterns a floating-point element is read as
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_LISTED = 8  # tensors named per group in the error; the rest counted
TP_CHUNK = 4096  # elements per sum of the TP comparison within a tolerance


class ReplicaMismatchError(RuntimeError):
    """Replicas that must be identical differ (raised on every rank alike)."""


@dataclass
class ReplicaSet:
    """Tensors that must be bitwise equal on every member of `group`, in the same order."""

    kind: str  # dp (dp_cp with cp > 1) | tp | embedding
    group: Group
    names: List[str]
    tensors: List[torch.Tensor]
    rtol: Optional[float] = None  # None: bitwise; else chunk sums within rtol x L1 norm


def fingerprint(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 checksum per tensor: the sum of its elements' bit patterns as integers."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    sums = [t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).sum(dtype=torch.int64)
            .to(device) for t in tensors]  # offload.optimizer: some are on the host
    return torch.stack(sums)


def chunks_of(tensor: torch.Tensor, chunk: int = TP_CHUNK) -> int:
    """How many chunks `sums_and_norms` makes of `tensor` (at least one)."""
    return max(1, -(-tensor.numel() // chunk))


def sums_and_norms(tensors: Sequence[torch.Tensor], device: torch.device,
                   chunk: int = TP_CHUNK) -> torch.Tensor:
    """Per chunk of `chunk` consecutive elements of each tensor, in order (`chunks_of` per
    tensor): (sum of its elements, sum of their magnitudes), in fp64: [chunks, 2]."""
    rows = [torch.zeros((0, 2), dtype=torch.float64, device=device)]
    for t in tensors:
        flat = t.detach().reshape(-1)
        full = flat.numel() // chunk * chunk
        parts = [flat[:full].view(-1, chunk)] if full else []
        if full < flat.numel() or not full:
            parts.append(flat[full:].view(1, -1))
        for part in parts:
            rows.append(torch.stack([part.sum(1, dtype=torch.float64),
                                     part.abs().sum(1, dtype=torch.float64)], 1).to(device))
    return torch.cat(rows)


def odd_within(sums: Sequence[float], norms: Sequence[float], rtol: float) -> List[int]:
    """Indices of the members whose sum differs from the (lower) median's by more than rtol
    times the largest norm (non-finite values always differ); every member when they are
    not a minority (two replicas that disagree)."""
    order = sorted(range(len(sums)), key=lambda i: (not math.isfinite(sums[i]), sums[i]))
    median = sums[order[(len(sums) - 1) // 2]]
    tol = rtol * max(norms)
    odd = [i for i, v in enumerate(sums) if not abs(v - median) <= tol]
    if odd and 2 * len(odd) >= len(sums):
        return list(range(len(sums)))
    return odd


def odd_members(values: Sequence[int]) -> List[int]:
    """Indices of the members whose checksum differs from the majority's; every member when
    there is no strict majority (two replicas that disagree)."""
    top, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return [i for i, v in enumerate(values) if v != top]
    return list(range(len(values)))


def disagreements(kind: str, ranks: List[int], names: List[str], table: List[list],
                  rtol: Optional[float] = None) -> List[str]:
    """What differs in one group: `table[i][j]` is member i's checksum of tensor j (with
    `rtol`: its [sum, L1 norm] of chunk j, `names[j]` the chunk's tensor, repeated for each of
    its chunks). One line per group with a mismatch, naming the group's ranks, the suspects and
    the tensors."""
    suspects: dict = {}  # tensor name -> suspect ranks, in order
    for j, name in enumerate(names):
        column = [row[j] for row in table]
        if rtol is not None:
            odd = odd_within([c[0] for c in column], [c[1] for c in column], rtol)
        else:
            odd = odd_members(column) if len(set(column)) > 1 else []
        if odd:
            known = suspects.setdefault(name, [])
            known += [ranks[i] for i in odd if ranks[i] not in known]
    bad = [(name, sorted(s)) for name, s in suspects.items()]
    if not bad:
        return []
    if rtol is not None:
        kind = f"{kind} (within resilience.tp_rtol={rtol:g})"
    listed = "; ".join(f"{name} (suspect rank{'s' if len(s) > 1 else ''} "
                       f"{', '.join(map(str, s))})" for name, s in bad[:MAX_LISTED])
    more = f"; and {len(bad) - MAX_LISTED} more tensors" if len(bad) > MAX_LISTED else ""
    return [f"{kind} replicas on global ranks {ranks} differ in {listed}{more}"]


def replica_sets(engine, topo: Topology, tp_rtol: float = 0.0) -> List[ReplicaSet]:
    """This rank's replicated tensors by group (groups of one rank left out); the TP set
    compared within `tp_rtol` without sequence parallelism (when > 0)."""
    layout = engine.layout
    dp, tp, emb, edp = ([], []), ([], []), ([], []), ([], [])
    if not layout.shards_parameters:
        for b in engine.buckets:
            for local, p, spec in zip(b.flat.names, b.params, b.flat.specs):
                name = f"{local} (the tied copy of {spec.name})" if spec.tied_copy else spec.name
                _add(edp if b.expert else dp, name, p)
                if spec.tp_replicated:
                    _add(tp, name, p)
                if b.tied:
                    _add(emb, name, p)
    else:  # zero 3: the parameters are DP shards; the fp32 master ranges stand for them
        for piece, seg, b in engine.main_params:
            name = f"{seg.spec.name}[{seg.param_lo}:{seg.param_hi}] (fp32 master range)"
            if seg.spec.tp_replicated:
                _add(tp, name, piece)
            if b.tied:
                _add(emb, name, piece)
    if not layout.shards_optimizer:  # zero 0: the optimizer state is replicated over DP
        for piece, seg, b in engine.main_params:
            into = edp if b.expert else dp
            if b.main is not b.param_region:
                _add(into, f"{seg.spec.name} (fp32 master)", piece)
            state = engine.adam_state(piece)
            for kind in MOMENTS:
                if kind in state:
                    _add(into, f"{seg.spec.name} (AdamW {kind})", state[kind])
    replicas = topo.grad_group  # DP, or DP x CP: the ranks holding the same parameters
    found = [(replicas.name, replicas, dp, None),
             ("tp", topo.tp_group, tp, None if layout.sequence_parallel or not tp_rtol
              else tp_rtol)]
    if edp[0]:  # ep > 1: the routed experts, replicated over EDP only
        found.append(("edp", topo.expert_grad_group, edp, None))
    if emb[0]:  # a tied copy (first or last stage of pp > 1): the rank is in the group
        found.append(("embedding", topo.embedding_group, emb, None))
    return [ReplicaSet(kind, group, names, tensors, rtol)
            for kind, group, (names, tensors), rtol in found if group.size > 1 and names]


def _add(into, name: str, tensor: torch.Tensor) -> None:
    into[0].append(name)
    into[1].append(tensor)


class ReplicaCheck:
    """The check of one rank (collective: every rank calls `check` at the same steps)."""

    def __init__(self, engine, topo: Topology, device: torch.device, check_every: int,
                 sequence_parallel: bool, tp_rtol: float = 0.0):
        self.engine, self.topo, self.device = engine, topo, device
        self.check_every, self.sequence_parallel = check_every, sequence_parallel
        self.tp_rtol = tp_rtol
        self.checks = 0  # passed so far
        self.passed_step: Optional[int] = None  # the step of the last check passed

    def due(self, step: int, saving: bool) -> bool:
        """Every `check_every` steps, and before every checkpoint."""
        return step % self.check_every == 0 or saving

    @torch.no_grad()
    def check(self, step: int) -> None:
        """Compare every replica set; raise ReplicaMismatchError on every rank if any differs
        anywhere in the world."""
        self.engine.wait_for_params()  # an overlapped parameter gather may still be running
        problems: List[str] = []
        for rs in replica_sets(self.engine, self.topo, self.tp_rtol):
            if rs.rtol is None:
                mine, names = fingerprint(rs.tensors, self.device), rs.names
            else:  # per chunk of each tensor
                mine = sums_and_norms(rs.tensors, self.device)
                names = [n for n, t in zip(rs.names, rs.tensors) for _ in range(chunks_of(t))]
            gathered = torch.empty((rs.group.size, *mine.shape), dtype=mine.dtype,
                                   device=self.device)
            comm.all_gather(gathered.view(-1), mine.reshape(-1), rs.group)
            problems += disagreements(rs.kind, rs.group.ranks, names, gathered.tolist(),
                                      rs.rtol)
        world = self.topo.world_group
        found = comm.all_reduce_scalars([float(len(problems))], world, self.device,
                                        op=dist.ReduceOp.MAX)[0]
        if found:
            raise ReplicaMismatchError(self._message(step, self._everyones(problems)))
        self.checks += 1
        self.passed_step = step

    def _everyones(self, problems: List[str]) -> List[str]:
        """Every rank's problem lines, on every rank (each group's members report alike)."""
        world = self.topo.world_group
        gathered = comm.gather_objects_to_root(problems, world)
        merged = None if gathered is None else list(dict.fromkeys(
            line for lines in gathered for line in lines))
        return comm.broadcast_object(merged, world)

    def _message(self, step: int, lines: List[str]) -> str:
        tp_note = ""
        if any(line.startswith("tp ") for line in lines) and not self.sequence_parallel:
            tp_note = (" Without sp each TP rank computes the gradients of the replicated "
                       "parameters itself: with resilience.tp_rtol=0 they are compared "
                       "bitwise, which nondeterministic kernels fail too; a drift beyond "
                       "resilience.tp_rtol also shows here." if not self.tp_rtol else
                       " Without sp each TP rank computes the gradients of the replicated "
                       "parameters itself; they differ beyond rounding drift "
                       "(resilience.tp_rtol).")
        return (f"replica check after step {step} (resilience.check_every={self.check_every}): "
                "values that must be identical on several ranks differ — silent data "
                "corruption on a suspect rank's device. " + ". ".join(lines) + "." + tp_note
                + f" The run stops without checkpointing step {step}; the checkpoints written "
                "with resilience.check_every > 0 passed the check at their step. Exclude the "
                "suspect ranks' nodes and resume (checkpoint.resume=auto).")
