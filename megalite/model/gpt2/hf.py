"""Mapping between `transformers.GPT2LMHeadModel` and megalite's GPT-2 state (GPT-2's
`HFMapping`; reading and writing transformers directories for any family: `megalite.model.hf_io`).

HF GPT-2 stores its linear layers as `Conv1D` with weight [in, out]; megalite uses nn.Linear
[out, in], so the mapping is: same names, Conv1D weights transposed, HF's attention-mask
buffers (`attn.bias`, `attn.masked_bias` in older versions) dropped, and one copy of the tied
embedding (`lm_head.weight` is `transformer.wte.weight`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.model.family import HFMapping, ModelKeys

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")
# GPT2Config switches megalite's model has one setting of (the accepted values; first = ours):
# tanh GELU, attention scaled by 1/sqrt(d) only, the LM head tied to the token embedding.
ARCHITECTURE = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"),
                "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
                "tie_word_embeddings": (True,)}


def hf_config(cfg: ModelConfig, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None):
    """The `transformers.GPT2Config` of a model shape. Special token ids come from the
    tokenizer; without one, GPT-2's 50256 where the vocabulary has it, else none."""
    from transformers import GPT2Config

    gpt2_eos = 50256 if cfg.vocab_size > 50256 else None
    eos = eos_token_id if eos_token_id is not None else gpt2_eos
    bos = bos_token_id if bos_token_id is not None else eos
    return GPT2Config(
        n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, n_positions=cfg.n_positions,
        vocab_size=cfg.vocab_size, n_inner=cfg.n_inner, resid_pdrop=cfg.resid_pdrop,
        embd_pdrop=cfg.embd_pdrop, attn_pdrop=cfg.attn_pdrop,
        layer_norm_epsilon=cfg.layer_norm_epsilon, initializer_range=cfg.initializer_range,
        activation_function="gelu_new", tie_word_embeddings=True,
        bos_token_id=bos, eos_token_id=eos,
    )


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel state -> megalite's global state (same names, nn.Linear layout,
    one copy of the tied embedding)."""
    out = {}
    for name, t in hf_sd.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        out[name] = t.t().contiguous() if name.endswith(CONV1D_SUFFIXES) else t
    return out


def to_hf_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """megalite's global state -> GPT2LMHeadModel names and Conv1D layout."""
    return {name: t.t().contiguous() if name.endswith(CONV1D_SUFFIXES) else t.contiguous()
            for name, t in sd.items()}


def check_shape_matches(cfg: ModelConfig, hf_cfg, source: str) -> None:
    """The model config must describe the checkpoint being loaded; name the first mismatch."""
    for key in SHAPE_FIELDS:
        theirs = getattr(hf_cfg, key)
        if getattr(cfg, key) != theirs:
            raise ConfigError(
                f"model.{key}={getattr(cfg, key)!r}: init_from={source!r} has {key}={theirs}; "
                f"pick the matching preset or set model.{key}={theirs}")
    theirs_inner = getattr(hf_cfg, "n_inner", None) or 4 * hf_cfg.n_embd
    if cfg.ffn_size != theirs_inner:
        raise ConfigError(f"model.n_inner={cfg.n_inner!r}: init_from={source!r} has an MLP of "
                          f"{theirs_inner}; set model.n_inner={theirs_inner}")
    if cfg.layer_norm_epsilon != hf_cfg.layer_norm_epsilon:
        raise ConfigError(f"model.layer_norm_epsilon={cfg.layer_norm_epsilon!r}: init_from="
                          f"{source!r} was trained with {hf_cfg.layer_norm_epsilon}; set "
                          f"model.layer_norm_epsilon={hf_cfg.layer_norm_epsilon}")
    for key, ours in ARCHITECTURE.items():
        theirs = getattr(hf_cfg, key, ours[0])
        if theirs not in ours:
            raise ConfigError(f"init_from={source!r}: {key}={theirs!r}, but megalite's GPT-2 "
                              f"has {key}={ours[0]!r}; its weights would compute another model")


def model_keys(hf_cfg, source: str) -> ModelKeys:
    """The model config of a GPT2Config (`init_from` takes the shape from config.json)."""
    shape = {key: getattr(hf_cfg, key) for key in SHAPE_FIELDS}
    shape.update(arch="gpt2", n_inner=getattr(hf_cfg, "n_inner", None),
                 layer_norm_epsilon=hf_cfg.layer_norm_epsilon, tie_word_embeddings=True)
    defaults = {key: getattr(hf_cfg, key) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop",
                                                      "initializer_range")}
    return ModelKeys(shape, defaults)


def derived(name: str) -> bool:
    """A key of the transformers state that megalite's state does not hold: the attention-mask
    buffers and the tied LM head."""
    return name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"


GPT2_MAPPING = HFMapping("gpt2", "GPT2LMHeadModel", "GPT-2", "gpt2", hf_config, to_hf_state_dict,
                         from_hf_state_dict, check_shape_matches, derived,
                         model_keys=model_keys)
