"""The pipeline's partition of the model's blocks into slices and their placement on the
pipeline ranks: `ChunkPlacement` (which slice each rank's chunk is: plain, interleaved or
zb-v's V), `partition_layers` (contiguous block ranges, balanced or with `edge_stage_layers`)
and `stage_chunks` (both together, per stage). Pure functions of sizes: the model, the
schedule, the plan and the planner all ask here (re-exported by `megalite.config.layout`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class ChunkPlacement:
    """Which model slices (virtual stages) each pipeline rank holds, as data: with v chunks
    per rank the model is cut into pp·v slices and "interleaved" puts slice c·pp + s on rank s
    as its chunk c (Megatron's virtual pipeline; v = 1 is the plain pipeline). Everything that
    asks where a slice lives — the partition, the model's first / last chunk, the schedule's
    transfers, the plan — asks this object, so another placement (zero-bubble's V) is a change
    here only."""

    pp_size: int
    virtual_stages: int = 1
    v_shape: bool = False  # zero-bubble ZB-V: 2 chunks, rank s holds slices s and 2p - 1 - s

    @property
    def slices(self) -> int:
        return self.pp_size * self.virtual_stages

    def slice_of(self, stage: int, chunk: int) -> int:
        """The model slice that is chunk `chunk` of pipeline rank `stage`."""
        if self.v_shape:
            return stage if chunk == 0 else 2 * self.pp_size - 1 - stage
        return chunk * self.pp_size + stage

    def owner(self, model_slice: int) -> Tuple[int, int]:
        """(stage, chunk) holding `model_slice`."""
        if self.v_shape:
            p = self.pp_size
            return (model_slice, 0) if model_slice < p else (2 * p - 1 - model_slice, 1)
        return model_slice % self.pp_size, model_slice // self.pp_size

    def holds_first(self, stage: int, chunk: int) -> bool:
        """Whether this chunk starts the model (token ids in: the embeddings)."""
        return self.slice_of(stage, chunk) == 0

    def holds_last(self, stage: int, chunk: int) -> bool:
        """Whether this chunk ends the model (the LM head and the loss)."""
        return self.slice_of(stage, chunk) == self.slices - 1

    def neighbour(self, stage: int, chunk: int, step: int) -> Optional[Tuple[int, int]]:
        """(stage, chunk) of the slice `step` (+1: next, -1: previous) away, None past the
        ends of the model."""
        target = self.slice_of(stage, chunk) + step
        return self.owner(target) if 0 <= target < self.slices else None


def edge_split_problem(n_layer: int, slices: int, edge: int) -> Optional[str]:
    """Why `edge` blocks on the first and last of `slices` model slices cannot work (every
    slice needs a block and the blocks must add up), or None."""
    rest = n_layer - 2 * edge
    if slices < 2 or edge < 1 or rest < slices - 2 or (slices == 2 and rest != 0):
        return (f"with pp*virtual_stages={slices} model slices and model.n_layer={n_layer} "
                "every slice needs at least one block and the blocks must add up; use null "
                f"(balanced) or a value k with 2k + ({slices}-2) <= n_layer (and 2k = n_layer "
                "for 2 slices)")
    return None


def partition_layers(n_layer: int, pp: int, edge_stage_layers: Optional[int] = None
                     ) -> List[range]:
    """Contiguous block ranges per stage. Balanced by default (the remainder goes to the
    middle stages first, as the edges also hold the embedding / head); with
    `edge_stage_layers=k` the first and last stage get k blocks each and the middle stages
    split the rest evenly."""
    if pp < 1 or n_layer < pp:
        raise ValueError(f"pp={pp} needs 1 <= pp <= n_layer={n_layer}")
    if pp == 1:
        return [range(n_layer)]
    if edge_stage_layers is None:
        counts = [n_layer // pp] * pp
        order = list(range(1, pp - 1)) + [0, pp - 1]
        for i in range(n_layer % pp):
            counts[order[i]] += 1
    else:
        problem = edge_split_problem(n_layer, pp, edge_stage_layers)
        if problem is not None:
            raise ValueError(f"edge_stage_layers={edge_stage_layers}: {problem}")
        middle, rest = pp - 2, n_layer - 2 * edge_stage_layers
        counts = [edge_stage_layers] + [rest // max(middle, 1)] * middle + [edge_stage_layers]
        for i in range(rest % max(middle, 1) if middle else 0):
            counts[1 + i] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def stage_chunks(n_layer: int, pp: int, v: int = 1, edge_stage_layers: Optional[int] = None,
                 v_shape: bool = False) -> List[List[range]]:
    """Per stage, the block ranges of its v model chunks: the model is partitioned into pp·v
    virtual stages (`partition_layers`), placed on the ranks by `ChunkPlacement` (`v_shape`:
    zb-v's V, where stage 0 holds the first and the last slice, so `edge_stage_layers` sizes
    both of its chunks)."""
    placement = ChunkPlacement(pp, v, v_shape)
    parts = partition_layers(n_layer, placement.slices, edge_stage_layers)
    return [[parts[placement.slice_of(s, c)] for c in range(v)] for s in range(pp)]
