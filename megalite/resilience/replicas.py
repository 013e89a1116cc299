"""Replica consistency (`resilience.check_every=N`): after the optimizer step of every N-th step,
and of every step that is checkpointed, the ranks that must hold identical values compare
checksums of them, and a difference stops the run on every rank, naming the step, the ranks
and the tensors. A GPU that computes a wrong number without an error (silent data corruption)
shows up as one replica that no longer equals the others.

What is compared, over which group (`megalite.parallel.topology`):

    dp         DP replicas: every model parameter under zero 0-2 (zero 3 shards them), and
               under zero 0 the optimizer state too (AdamW's moments, and the fp32 master
               weights where they are not the parameters themselves)
    tp         TP replicas of the parameters TP does not split (LayerNorms, the biases of
               row-parallel layers, wpe); under zero 3 their fp32 master ranges
    embedding  the tied embedding's two copies, on the first and the last pipeline stage

Every comparison is bitwise. The checksum of a tensor is the sum of its elements' bit
patterns read as integers (int32 for fp32, int16 for bf16/fp16), accumulated in int64: exact
and order-independent, so equal tensors give equal sums on any device, and any change of one
element (one flipped bit changes the sum by ±2^k) changes it. Changes of several elements can
cancel, with a probability that does not matter for one faulty element. Each rank sends one
int64 per tensor (an all_gather per group, counted with the group's traffic).

Why bitwise holds: DP replicas apply the same all-reduced (or all-gathered) values with the
same kernels. TP replicas of replicated parameters under sequence parallelism get their
gradients summed by an all-reduce, which hands every rank the same bits. Without sequence
parallelism each TP rank computes those gradients itself, from the same (all-reduced)
activations: the replicas stay equal only if every TP rank's kernels are deterministic — the
assumption this check makes (Megatron compares DP replicas only). A nondeterministic kernel
there (atomics in a reduction) fails the check as a TP mismatch with sp=false; the error says
so. The tied embedding's copies get the same summed gradient and the same update.

With two replicas a mismatch cannot say which one is wrong, and both ranks are named; with
three or more, the ranks that differ from the majority are.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.bucket import MOMENTS
from megalite.parallel.comm import Group
from megalite.parallel.topology import Topology

# the integer type whose bit patterns a floating-point element is read as
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_LISTED = 8  # tensors named per group in the error; the rest counted


class ReplicaMismatchError(RuntimeError):
    """Replicas that must be identical differ (raised on every rank alike)."""


@dataclass
class ReplicaSet:
    """Tensors that must be bitwise equal on every member of `group`, in the same order."""

    kind: str  # dp | tp | embedding
    group: Group
    names: List[str]
    tensors: List[torch.Tensor]


def fingerprint(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One int64 checksum per tensor: the sum of its elements' bit patterns as integers."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    sums = [t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).sum(dtype=torch.int64)
            .to(device) for t in tensors]  # offload.optimizer: some are on the host
    return torch.stack(sums)


def odd_members(values: Sequence[int]) -> List[int]:
    """Indices of the members whose checksum differs from the majority's; every member when
    there is no strict majority (two replicas that disagree)."""
    top, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return [i for i, v in enumerate(values) if v != top]
    return list(range(len(values)))


def disagreements(kind: str, ranks: List[int], names: List[str], table: List[List[int]]
                  ) -> List[str]:
    """What differs in one group: `table[i][j]` is member i's checksum of tensor j. One line per
    group with a mismatch, naming the group's ranks, the suspects and the tensors."""
    bad = []
    for j, name in enumerate(names):
        column = [row[j] for row in table]
        if len(set(column)) > 1:
            bad.append((name, [ranks[i] for i in odd_members(column)]))
    if not bad:
        return []
    listed = "; ".join(f"{name} (suspect rank{'s' if len(s) > 1 else ''} "
                       f"{', '.join(map(str, s))})" for name, s in bad[:MAX_LISTED])
    more = f"; and {len(bad) - MAX_LISTED} more tensors" if len(bad) > MAX_LISTED else ""
    return [f"{kind} replicas on global ranks {ranks} differ in {listed}{more}"]


def replica_sets(engine, topo: Topology) -> List[ReplicaSet]:
    """This rank's replicated tensors by group (groups of one rank left out)."""
    layout = engine.layout
    dp, tp, emb = ([], []), ([], []), ([], [])
    if not layout.shards_parameters:
        for b in engine.buckets:
            for local, p, spec in zip(b.flat.names, b.params, b.flat.specs):
                name = f"{local} (the tied copy of {spec.name})" if spec.tied_copy else spec.name
                _add(dp, name, p)
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
            if b.main is not b.param_region:
                _add(dp, f"{seg.spec.name} (fp32 master)", piece)
            state = engine.adam_state(piece)
            for kind in MOMENTS:
                if kind in state:
                    _add(dp, f"{seg.spec.name} (AdamW {kind})", state[kind])
    found = [("dp", topo.dp_group, dp), ("tp", topo.tp_group, tp)]
    if topo.pp_size > 1:
        found.append(("embedding", topo.embedding_group, emb))
    return [ReplicaSet(kind, group, names, tensors) for kind, group, (names, tensors) in found
            if group.size > 1 and names]


def _add(into, name: str, tensor: torch.Tensor) -> None:
    into[0].append(name)
    into[1].append(tensor)


class ReplicaCheck:
    """The check of one rank (collective: every rank calls `check` at the same steps)."""

    def __init__(self, engine, topo: Topology, device: torch.device, check_every: int,
                 sequence_parallel: bool):
        self.engine, self.topo, self.device = engine, topo, device
        self.check_every, self.sequence_parallel = check_every, sequence_parallel
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
        for rs in replica_sets(self.engine, self.topo):
            mine = fingerprint(rs.tensors, self.device)
            gathered = torch.empty(rs.group.size * mine.numel(), dtype=torch.int64,
                                   device=self.device)
            comm.all_gather(gathered, mine, rs.group)
            table = gathered.view(rs.group.size, -1).tolist()
            problems += disagreements(rs.kind, rs.group.ranks, rs.names, table)
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
            tp_note = (" TP replicas of replicated parameters are equal only if every TP "
                       "rank's kernels are deterministic (sp=false: each TP rank computes "
                       "their gradients itself); a nondeterministic kernel fails here too.")
        return (f"replica check after step {step} (resilience.check_every={self.check_every}): "
                "values that must be identical on several ranks differ — silent data "
                "corruption on a suspect rank's device. " + ". ".join(lines) + "." + tp_note
                + f" The run stops without checkpointing step {step}; the checkpoints written "
                "with resilience.check_every > 0 passed the check at their step. Exclude the "
                "suspect ranks' nodes and resume (checkpoint.resume=auto).")
