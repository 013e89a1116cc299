"""The memory plan's view of one stage's model chunks under any placement (`ChunkPlacement`,
`megalite.plan.memory`): which chunk holds the embeddings, which the LM head, and whether that head
is a second copy of the token embedding (its gradient summed with the first stage's over the
embedding group) or the embedding itself — in a single-stage model, and under zb-v's V, where
stage 0 holds both ends of the model (`megalite.model.stage.tie_across_chunks`). An untied
head (`model.tie_word_embeddings=false`) is a parameter of its own everywhere, summed with
nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megalite.config.stage_partition import ChunkPlacement


@dataclass(frozen=True)
class ChunkEnds:
    first: bool  # holds the embeddings
    last: bool  # holds the final norm, the LM head and the loss
    head_copy: bool  # last, and the head is a parameter of its own (a copy of the tied
    #                  embedding on a stage without it, or an untied head)
    tied: bool = True  # the embedding's spec is `tied` (not zb-v's stage 0: one parameter)
    blocks: Optional[range] = None  # the blocks it holds, where known (each planned as itself)


def stage_ends(placement: ChunkPlacement, stage: int, tied: bool = True) -> List[ChunkEnds]:
    """Per chunk of `stage`, what it holds of the model's ends (`tied`: the model's LM head is
    its token embedding)."""
    firsts = [placement.holds_first(stage, c) for c in range(placement.virtual_stages)]
    lasts = [placement.holds_last(stage, c) for c in range(placement.virtual_stages)]
    if not tied:
        return [ChunkEnds(f, lst, lst, False) for f, lst in zip(firsts, lasts)]
    one = firsts == lasts or not (any(firsts) and any(lasts))  # not two chunks' ends
    return [ChunkEnds(f, lst, lst and not any(firsts), one) for f, lst in zip(firsts, lasts)]


def ties_over_stages(placement: ChunkPlacement, stage: int, tied: bool = True) -> bool:
    """Whether `stage`'s embedding (or head copy) is summed with another stage's: the head is
    tied and the stage holds one end of the model and not the other (pp = 1 and zb-v's stage 0
    hold both)."""
    ends = stage_ends(placement, stage, tied)
    return tied and any(e.first for e in ends) != any(e.last for e in ends)
