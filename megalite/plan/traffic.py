"""A layout's parameters and wire bytes per stage without its memory peak: the plan's own terms
(`megalite.plan.stage_terms`: `add_chunk`, `stage_comm`), skipping the schedule walk and the bucket
staging that only the memory figures need, so the search can predict thousands of layouts and
plan the memory of the few it proposes. Equal to `make_plan(...).stages`' params and comm (a
test holds them equal)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.plan.chunks import stage_ends, ties_over_stages
from megalite.plan.dims import dims
from megalite.plan.stage_terms import StageSums, add_chunk, stage_comm, zero3_gathered


@dataclass
class StageTraffic:
    stage: int
    params: int  # Ψ per rank
    comm: Dict[str, float]  # wire bytes per step per group
    gathers: int = 0  # ZeRO-3's unit all-gathers a step (`zero3_gathered`)


def stage_traffic(cfg: Config, layout: Layout) -> List[StageTraffic]:
    d, place = dims(cfg, layout), layout.placement
    out = []
    for k, chunks in enumerate(layout.stage_blocks()):
        sums = StageSums()
        tied_family = cfg.model.tie_word_embeddings
        for e, blocks in zip(stage_ends(place, k, tied_family), chunks):
            add_chunk(sums, d, e.first, e.last, len(blocks), e.head_copy, blocks)
        tied = layout.pp_size > 1 and ties_over_stages(place, k, tied_family)
        gathers = zero3_gathered(d, sums, k)[2] if layout.zero_stage == 3 else 0
        out.append(StageTraffic(k, sums.psi, stage_comm(d, sums, tied, k), gathers))
    return out
