"""Simulated scale: build rank R of an N-rank layout for real on this machine and set what it
holds next to the plan (ARCHITECTURE.md §10; the command is `megalite.cli.verify_rank`).

    python scripts/verify_rank.py --verify-rank R --world-size N [--device cuda|cpu] [--json] \\
        model=gpt2-xl pp=2 zero=3 train.seq_len=1024 train.micro_batch_size=4 ...

Real: the checks of a launch (`megalite.config.layout.validate`, `Layout.from_config`), the
`Topology` with every process group of the grid (each created by `dist.new_group` over the
whole world, in the same order as a launch), the stage partition, rank R's model stage (its
parameters and `ParamSpec`s, through `megalite.train.build.build_model`), the ZeRO engine (flat
buffers, buckets, the owned shard of each) and its AdamW.

Simulated: the collectives, by PyTorch's fake process-group backend
(`torch.testing._internal.distributed.fake_pg`: `FakeStore` and `init_process_group("fake")`,
in torch since 2.1, this project needs torch >= 2.3; checked on 2.13), which creates every
group and answers every collective without communicating; and the values: every tensor lives
on the meta device (shape and dtype, no storage), so nothing is initialised or loaded, a
175B-parameter stage costs no memory, and anything that read a value (`.item()`, a copy to
the host) would fail instead of passing unnoticed.

The report: planned bytes of rank R's pipeline stage (`megalite.plan.memory.make_plan`) and built
bytes (`ZeroEngine.state_bytes()`, which counts AdamW's moments before the first step
creates them) per state — P parameters, G gradients, O optimizer state — and the seconds each
part took to build. The built side includes the flat buffers' padding to a multiple of the DP
size (fewer than dp elements per bucket), which the plan leaves out: P, G and the master weights
of the ranks holding it are a little above the plan, their AdamW moments (none for padding)
below it (`owned_padding`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megalite.config.layout import Layout
from megalite.config.schema import DEFAULT_RANK_ORDER, Config
from megalite.model.stage import PipelineStage
from megalite.parallel.rng import RNGTracker
from megalite.parallel.topology import Topology, build_topology, group_ranks
from megalite.parallel.zero import ZeroEngine
from megalite.plan.memory import make_plan
from megalite.train.build import build_engine, build_model
from megalite.train.runtime import Runtime

META = torch.device("meta")
STATES = (("P", "params"), ("G", "grads"), ("O", "optimizer"))
FAKE_BACKEND_NEEDED = (
    "--verify-rank simulates the other ranks with PyTorch's fake process-group backend "
    "(torch.testing._internal.distributed.fake_pg, in torch >= 2.1; checked on 2.13), which "
    "this torch {version} does not have: install torch >= 2.3 (the project's minimum)")


class FakeBackendMissing(RuntimeError):
    """This torch has no fake process-group backend."""


def fake_store():
    """PyTorch's `FakeStore` (a private testing module: imported here only)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise FakeBackendMissing(FAKE_BACKEND_NEEDED.format(version=torch.__version__)) from e
    return FakeStore()


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size` simulated ranks (the fake backend); the
    process group, and every group made in it, destroyed on exit."""
    if dist.is_initialized():
        raise RuntimeError("verify_rank builds its own simulated process group, and this "
                           "process already has one: run it in a fresh process")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_parts(cfg: Config, layout: Layout) -> Tuple[Topology, PipelineStage, ZeroEngine,
                                                      Dict[str, float]]:
    """Inside a `fake_world`: this rank's topology, model stage (on meta) and ZeRO engine,
    built as a launch builds them, and the seconds each took ("total": the three; "imports":
    torch._dynamo, which `torch.optim.Optimizer` imports on its first construction in a
    process, 1.5-5 s on a 2-core machine, timed apart so that it does not hide in the
    engine's figure)."""
    clock = time.perf_counter
    before_imports = clock()
    import torch._dynamo  # noqa: F401  (what AdamW's constructor imports the first time)
    start = clock()
    topo = build_topology(layout.tp_size, layout.pp_size, layout.dp_size, cp=layout.cp_size,
                          ep=layout.ep_size, order=layout.rank_order,
                          timeout_s=cfg.parallel.timeout_s,
                          checkpoint_timeout_s=cfg.checkpoint.timeout_s)
    built_topology = clock()
    c = topo.coords
    blocks = layout.blocks_of(c.pp_rank)
    rng = RNGTracker(cfg.seed, c.tp_rank, c.pp_rank, topo.grad_group.rank, META)
    model = build_model(cfg, Runtime(layout, topo, META), blocks, rng)
    built_model = clock()
    engine = build_engine(cfg, layout, topo, model)
    done = clock()
    return topo, model, engine, {"imports": start - before_imports,
                                 "topology": built_topology - start,
                                 "model": built_model - built_topology,
                                 "engine": done - built_model, "total": done - start}


@dataclass
class RankReport:
    """Rank R built next to its plan."""

    rank: int
    layout: Layout
    coords: Dict[str, int]
    groups: Dict[str, int]  # kind -> size of this rank's group
    groups_created: int  # dist.new_group calls (groups of more than one rank)
    stage: int
    blocks: List[List[int]]  # [start, stop) of each model chunk
    params: Dict[str, int]  # parameter elements of this rank: planned, built
    buckets: int
    padding: int  # elements of flat-buffer padding inside this rank's owned ranges
    planned: Dict[str, float]  # bytes per state (params, grads, optimizer)
    built: Dict[str, int]
    seconds: Dict[str, float]

    def ratio(self, state: str) -> float:
        """built / planned bytes of `state` (1.0 when both are 0)."""
        planned, built = self.planned[state], self.built[state]
        return built / planned if planned else (1.0 if built == 0 else float("inf"))

    def as_dict(self) -> dict:
        return {"rank": self.rank, "layout": self.layout.as_dict(),
                "precision": self.layout.precision, "coords": self.coords,
                "groups": self.groups, "groups_created": self.groups_created,
                "stage": self.stage, "blocks": self.blocks, "params": self.params,
                "buckets": self.buckets, "padding": self.padding,
                "bytes": {letter: {"planned": self.planned[k], "built": self.built[k],
                                   "ratio": self.ratio(k)} for letter, k in STATES},
                "seconds": self.seconds}

    def table(self) -> str:
        lay, c = self.layout, self.coords
        lines = [
            f"verify-rank: rank {self.rank} of {lay.world_size} (tp {c['tp']}/{lay.tp_size}, "
            f"cp {c['cp']}/{lay.cp_size}, pp {c['pp']}/{lay.pp_size}, "
            f"dp {c['dp']}/{lay.dp_size}{_order(lay)}), zero={lay.zero_stage} "
            f"sp={lay.sequence_parallel} virtual_stages={lay.virtual_stages} "
            f"{lay.precision} ({lay.device_type}); tensors on meta, collectives on PyTorch's "
            "fake backend",
            "this rank's groups: " + ", ".join(f"{k} {v}" for k, v in self.groups.items())
            + f" ({self.groups_created:,} groups created)",
            f"pipeline stage {self.stage}: blocks "
            + ", ".join(f"{a}-{b - 1}" for a, b in self.blocks)
            + f"; {self.params['built']:,} parameters (plan {self.params['planned']:,}); "
            f"{self.buckets} ZeRO buckets, {self.padding:,} padding elements in its ranges",
            f"{'state':<12} {'planned bytes':>16} {'built bytes':>16} {'built/plan':>10}"]
        for letter, key in STATES:
            lines.append(f"{letter + ' ' + key:<12} {self.planned[key]:>16,.0f} "
                         f"{self.built[key]:>16,} {self.ratio(key):>10.4f}")
        if self.padding and self.ratio("optimizer") < 0.99:
            lines.append(f"O is below the plan: the {self.padding:,} padding elements in this "
                         "rank's ranges have master weights but no AdamW moments (8 bytes each)")
        s = self.seconds
        lines.append(f"built in {s['total']:.2f} s (topology {s['topology']:.2f} s, model stage "
                     f"{s['model']:.2f} s, ZeRO engine and AdamW {s['engine']:.2f} s), "
                     f"after {s['imports']:.2f} s of one-time imports")
        return "\n".join(lines)


def report(cfg: Config, layout: Layout, topo: Topology, model: PipelineStage,
           engine: ZeroEngine, seconds: Dict[str, float]) -> RankReport:
    """The built objects of this rank set next to `make_plan`'s stage."""
    c = topo.coords
    planned = make_plan(cfg, layout).stages[c.pp_rank]
    kinds = group_ranks(layout.tp_size, layout.pp_size, layout.dp_size, layout.cp_size,
                        order=layout.rank_order)
    return RankReport(
        rank=topo.rank, layout=layout,
        coords={"tp": c.tp_rank, "cp": c.cp_rank, "pp": c.pp_rank, "dp": c.dp_rank},
        groups={k: g.size for k, g in topo.groups.items()},
        groups_created=sum(len(r) > 1 for lists in kinds.values() for r in lists)
        + ("checkpoint" in topo.groups and layout.world_size > 1),
        stage=c.pp_rank, blocks=[[b.start, b.stop] for b in (m.blocks for m in model.chunks)],
        params={"planned": planned.params,
                "built": sum(p.numel() for p in model.parameters())},
        buckets=len(engine.buckets), padding=owned_padding(engine),
        planned={k: planned.bytes[k] for _, k in STATES},
        built=engine.state_bytes(), seconds=seconds)


def _order(layout: Layout) -> str:
    """The rank order where it is not the default (`parallel.rank_order`)."""
    return "" if layout.rank_order == DEFAULT_RANK_ORDER else f"; ranks {layout.rank_order}"


def owned_padding(engine: ZeroEngine) -> int:
    """Padding elements in this rank's owned ranges. Each flat buffer is padded to a multiple
    of N (`megalite.parallel.flat`), the padding at its end, so the last DP ranks hold it: it
    has master weights but no AdamW moments (they exist per parameter piece), so there O is
    up to 8 bytes × padding below the plan's 12Ψ/N."""
    return sum(b.hi - b.lo - sum(seg.numel for seg in b.segments) for b in engine.buckets)


def verify_rank(cfg: Config, layout: Layout, rank: int) -> RankReport:
    """Build rank `rank` of `layout` (`cfg` validated for it) in a fake world of
    `layout.world_size` ranks and compare it with the plan."""
    with fake_world(rank, layout.world_size):
        topo, model, engine, seconds = build_parts(cfg, layout)
        return report(cfg, layout, topo, model, engine, seconds)
