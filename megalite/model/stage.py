"""This rank's part of the model: the chunks of its pipeline stage, of the model's family.

Without an interleaved schedule a stage is one chunk, a contiguous slice of blocks. With
`parallel.virtual_stages=v` the model is cut into pp·v slices and stage s holds slices s,
s + pp, s + 2·pp, ... (`Layout.stage_blocks`): the first chunk of stage 0
has the embeddings, the last chunk of the last stage the final norm, the LM head and the
loss. Under zb-v's V placement (`ChunkPlacement(v_shape=True)`) stage s holds slices s and
2·pp - 1 - s, so stage 0 holds both ends: with a tied embedding its LM head is its
embedding's own parameter (one tensor, as in a single-stage model; nothing to sum over an
embedding group, and a checkpoint sees one `transformer.wte.weight`, as from any layout); an
untied head (Llama) is a parameter of its own there as everywhere. Block names are global
(`transformer.h.<index>`, `model.layers.<index>`), so checkpoints and initialisation do not
depend on which chunk holds a block.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch.nn as nn

from megalite.config.stage_partition import ChunkPlacement
from megalite.model.causal_lm import CausalLM
from megalite.model.families import causal_lm, family
from megalite.parallel.param_spec import ParamSpec


class PipelineStage(nn.Module):
    """The model chunks of one pipeline stage, in the order the schedule numbers them."""

    def __init__(self, chunks: List[CausalLM]):
        super().__init__()
        self.models = nn.ModuleList(chunks)
        self.param_specs: Dict[str, ParamSpec] = {
            f"models.{i}.{name}": spec for i, chunk in enumerate(chunks)
            for name, spec in chunk.param_specs.items()}
        self.padded_vocab = chunks[0].padded_vocab
        self.family = chunks[0].family  # the model's family (`megalite.model.family.Family`)
        self.activation_offload = chunks[0].offload  # one for all chunks, or None

    @property
    def chunks(self) -> List[CausalLM]:
        return list(self.models)


def build_stage(cfg, blocks: List[range], stage: int, pp: int, v_shape: bool = False,
                **kwargs) -> PipelineStage:
    """The chunks of pipeline stage `stage` holding `blocks` (one range per chunk; `v_shape`:
    placed in zb-v's V); `kwargs` go to every chunk of `cfg`'s family (`CausalLM`: tp group,
    sequence parallelism, RNG, recompute, compile, attention, activation offload)."""
    placement = ChunkPlacement(pp, len(blocks), v_shape)
    chunks = [causal_lm(cfg, blocks=r, first=placement.holds_first(stage, c),
                        last=placement.holds_last(stage, c), **kwargs)
              for c, r in enumerate(blocks)]
    firsts, lasts = [c for c in chunks if c.first], [c for c in chunks if c.last]
    if firsts and lasts and firsts[0] is not lasts[0] and family(cfg).tied(cfg):
        tie_across_chunks(firsts[0], lasts[0])
    return PipelineStage(chunks)


def tie_across_chunks(first: CausalLM, last: CausalLM) -> None:
    """The LM head of chunk `last` becomes the token embedding of chunk `first` (the same
    stage): one parameter, not tied over ranks. Both chunks list it (the engine buckets it
    once and expects its two gradient accumulations per micro-batch); the head's spec stays
    a `tied_copy` (never written, never counted twice)."""
    weight = first.token_embedding().weight
    last.lm_head.weight = weight
    name = f"{first.family.embedding_module}.weight"
    spec = dataclasses.replace(first.param_specs[name], tied=False)
    first.param_specs[name] = spec
    last.param_specs["lm_head.weight"] = dataclasses.replace(spec, tied_copy=True)
