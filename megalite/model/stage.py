"""This rank's part of the model: the GPT-2 chunks of its pipeline stage.

Without an interleaved schedule a stage is one chunk, a contiguous slice of blocks. With
`parallel.virtual_stages=v` the model is cut into pp·v slices and stage s holds slices s,
s + pp, s + 2·pp, ... (`megalite.layout.stage_chunks`): the first chunk of stage 0
has the embeddings, the last chunk of the last stage ln_f, the LM head and the loss. Block
names are global (`transformer.h.<index>`), so checkpoints and initialisation do not depend on
which chunk holds a block.
"""
from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from megalite.layout import ChunkPlacement
from megalite.model.gpt2 import GPT2
from megalite.parallel.param_spec import ParamSpec


class PipelineStage(nn.Module):
    """The model chunks of one pipeline stage, in the order the schedule numbers them."""

    def __init__(self, chunks: List[GPT2]):
        super().__init__()
        self.models = nn.ModuleList(chunks)
        self.param_specs: Dict[str, ParamSpec] = {
            f"models.{i}.{name}": spec for i, chunk in enumerate(chunks)
            for name, spec in chunk.param_specs.items()}
        self.padded_vocab = chunks[0].padded_vocab
        self.activation_offload = chunks[0].offload  # one for all chunks, or None

    @property
    def chunks(self) -> List[GPT2]:
        return list(self.models)


def build_stage(cfg, blocks: List[range], stage: int, pp: int, **kwargs) -> PipelineStage:
    """The chunks of pipeline stage `stage` holding `blocks` (one range per chunk); `kwargs`
    go to every `GPT2` (tp group, sequence parallelism, RNG, recompute, compile, attention,
    activation offload)."""
    placement = ChunkPlacement(pp, len(blocks))
    return PipelineStage([GPT2(cfg, blocks=r, first=placement.holds_first(stage, c),
                               last=placement.holds_last(stage, c), **kwargs)
                          for c, r in enumerate(blocks)])
