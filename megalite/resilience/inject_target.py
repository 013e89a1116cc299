"""Before launch (`megalite.train.preflight`): the fault drill's tensor (`resilience.inject`)
is one the drill's rank holds, and its element inside that rank's copy. The rank's pipeline
stage is built on the meta device (shapes, no memory, no values, no process group) from the
blocks its `Layout` gives it — the same chunks, in the same placement (interleaved, zb-v's V),
as the run builds."""
from __future__ import annotations

import math

import torch

from megalite.config.errors import fail
from megalite.config.inject import KEY, parse_inject
from megalite.config.layout import Layout
from megalite.model.families import family
from megalite.model.stage import build_stage
from megalite.parallel.group import CommCounter, Group
from megalite.parallel.topology import coords_of


def check_inject_target(cfg, layout: Layout) -> None:
    """ConfigError naming resilience.inject when the drill's rank holds no such tensor (its
    pipeline stage has other blocks, or not the embeddings / ln_f / the head) or the element
    is beyond its copy (its TP shard)."""
    spec = cfg.resilience.inject
    parsed = parse_inject(spec, family(cfg.model).probe_tensor)
    numels = rank_parameters(cfg, layout, parsed.rank)
    if parsed.tensor not in numels:
        fail(KEY, spec, f"rank {parsed.rank} holds no parameter {parsed.tensor} (its pipeline "
             f"stage has other blocks); its parameters are e.g. "
             f"{', '.join(list(numels)[:4])}, ...")
    if parsed.index >= numels[parsed.tensor]:
        fail(KEY, spec, f"index={parsed.index} but rank {parsed.rank}'s copy of "
             f"{parsed.tensor} has {numels[parsed.tensor]} elements: use an index < "
             f"{numels[parsed.tensor]}")


def rank_parameters(cfg, layout: Layout, rank: int) -> dict:
    """Global name -> elements of the copy `rank` holds (its TP shard; an expert weight under
    ep > 1: its EP rank's E/ep whole experts, `ParamSpec.local_shape`), of every parameter the
    fault drill can target on that rank (tied copies left out, as the drill takes the first
    copy)."""
    c = coords_of(rank, layout.tp_size, layout.pp_size, layout.cp_size, layout.dp_size,
                  layout.rank_order)
    group = Group(name="tp", ranks=list(range(layout.tp_size)), rank=c.tp_rank, pg=None,
                  counter=CommCounter())
    with torch.device("meta"):
        stage = build_stage(cfg.model, layout.blocks_of(c.pp_rank), c.pp_rank, layout.pp_size,
                            layout.v_shape, tp_group=group,
                            sequence_parallel=layout.sequence_parallel)
    numels = {}
    for chunk in stage.chunks:
        for local, p in chunk.named_parameters():
            spec = chunk.param_specs[local]
            if spec.tied_copy:
                continue
            numels.setdefault(spec.name, math.prod(spec.local_shape(1, cfg.ep))
                              if spec.expert and cfg.ep > 1 else p.numel())
    return numels
