"""torchtitan's Llama 3 state <-> megalite's Llama state (HF names, `megalite.model.llama.hf`):
Llama's `DCPMapping`, the names `megalite.checkpoint.dcp_export` writes and reads.

torchtitan (0.3.0, `torchtitan.models.llama3`) names a block's tensors
`layers.<i>.attention.qkv_linear.{wq,wk,wv}.weight`, `layers.<i>.attention.wo.weight`,
`layers.<i>.feed_forward.{w1,w2,w3}.weight` (gate, down, up), `layers.<i>.{attention,ffn}_norm.weight`,
and the ends `tok_embeddings.weight`, `norm.weight`, `lm_head.weight` (with weight tying both the
embedding and the head are in its state, one tensor). megalite holds gate and up as one
`gate_up_proj` ([gate | up] along the output dimension).

The rotary layout differs (torchtitan's `Llama3StateDictAdapter`, after Meta's and HF's
`convert_llama_weights_to_hf.py`): torchtitan rotates interleaved pairs of a head's query/key
rows (complex RoPE: rows 2j, 2j+1 are one pair), megalite and HF rotate halves (rows j and
j + d/2). So each head's rows of wq and wk are permuted: `to_interleaved` on the way to
torchtitan, `to_rotate_half` on the way back; either alone is the identity nowhere but
d = 2, and a wrong one gives another model (the tests compare logits against torchtitan's own
forward, so a wrong permutation fails them).
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, Tuple

import torch

from megalite.config.schema import ModelConfig
from megalite.model.family import DCPMapping
from megalite.model.llama.hf import GATE_UP

# megalite's per-block suffix (after `model.layers.<i>.`) -> torchtitan's (after `layers.<i>.`)
BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GATE, UP = "feed_forward.w1.weight", "feed_forward.w3.weight"
END_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight",
             "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
OURS_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
TITAN_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from rotate-half order (HF) to interleaved pairs (torchtitan, Meta)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_interleaved`: interleaved pairs back to rotate-half order."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads(suffix: str, cfg: ModelConfig) -> int:
    return cfg.n_head if suffix.endswith("wq.weight") else cfg.kv_heads


def titan_tensors(name: str, t: torch.Tensor, cfg: ModelConfig
                  ) -> Iterator[Tuple[str, torch.Tensor]]:
    """torchtitan's tensors made from one megalite tensor: renamed, the gate/up pair split,
    query/key rows interleaved; a tied embedding is also the head."""
    block = OURS_BLOCK.match(name)
    if block is None:
        yield END_NAMES[name], t
        if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings:
            yield "lm_head.weight", t
        return
    layer, suffix = block.groups()
    if "." + suffix == GATE_UP:
        gate, up = t.chunk(2, dim=0)
        yield f"layers.{layer}.{GATE}", gate.contiguous()
        yield f"layers.{layer}.{UP}", up.contiguous()
        return
    theirs = BLOCK_NAMES[suffix]
    if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        t = to_interleaved(t, _heads(theirs, cfg))
    yield f"layers.{layer}.{theirs}", t.contiguous()


def is_model_key(key: str) -> bool:
    """Whether a key of a torchtitan checkpoint is a Llama 3 weight (a training checkpoint
    also holds `optimizer`, `lr_scheduler`, `dataloader`, `train_state` entries)."""
    block = TITAN_BLOCK.match(key)
    if block is not None:
        return block.group(2) in (*BLOCK_NAMES.values(), GATE, UP)
    return key in END_NAMES.values()


def from_titan(state: Dict[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """torchtitan's Llama 3 weights -> megalite's global state (HF names, gate/up stacked,
    query/key rows in rotate-half order; the head dropped where tied)."""
    back_block = {v: k for k, v in BLOCK_NAMES.items()}
    back_end = {v: k for k, v in END_NAMES.items()}
    out = {}
    for key, t in state.items():
        block = TITAN_BLOCK.match(key)
        if block is None:
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[back_end[key]] = t
            continue
        layer, suffix = block.groups()
        if suffix == UP:
            continue
        if suffix == GATE:
            up = state[f"layers.{layer}.{UP}"]
            out[f"model.layers.{layer}{GATE_UP}"] = torch.cat([t, up], dim=0)
            continue
        if suffix.endswith(("wq.weight", "wk.weight")):
            t = to_rotate_half(t, _heads(suffix, cfg))
        out[f"model.layers.{layer}.{back_block[suffix]}"] = t.contiguous()
    return out


LLAMA_DCP = DCPMapping("torchtitan's Llama 3", titan_tensors, from_titan, is_model_key)
