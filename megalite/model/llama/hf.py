"""Mapping between `transformers.LlamaForCausalLM` and megalite's Llama state (Llama's
`HFMapping`; directories are read and written by `megalite.model.hf_io`).

Names are transformers' except the MLP's gate and up projections, which megalite holds as one
parameter `model.layers.<i>.mlp.gate_up_proj.weight` = [gate_proj | up_proj] along the output
dimension (split over TP as two blocks, `ParamSpec.tp_interleave=2`): the mapping stacks them
on the way in and splits them on the way out. Both sides use nn.Linear's [out, in]. A tied
head (`tie_word_embeddings`) is one tensor, the token embedding; transformers' rotary
`inv_freq` buffers are derived, not state.

`check_config` holds a `LlamaConfig` to the model config: every shape key, the RMSNorm's eps,
rope_theta and Llama 3's rope_scaling (transformers 4's `rope_theta` / `rope_scaling` or
transformers 5's `rope_parameters`), the tie, and the switches megalite's Llama has one
setting of (SiLU, no biases, head_dim = hidden_size / heads).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Dict, Optional, Tuple

import torch

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig, RopeScaling
from megalite.model.family import HFMapping, ModelKeys

GATE_UP = ".mlp.gate_up_proj.weight"
# LlamaConfig switches megalite's Llama has one setting of (accepted values; first = ours)
ARCHITECTURE = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                "pretraining_tp": (1,)}
# model.<key> -> the LlamaConfig field it is
FIELDS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
          "n_kv_head": "num_key_value_heads", "n_positions": "max_position_embeddings",
          "vocab_size": "vocab_size", "n_inner": "intermediate_size",
          "layer_norm_epsilon": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}


def hf_config(cfg: ModelConfig, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None):
    """The `transformers.LlamaConfig` of a model shape; special token ids from the tokenizer
    (none without one)."""
    from transformers import LlamaConfig

    scaling = asdict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
        max_position_embeddings=cfg.n_positions, rms_norm_eps=cfg.layer_norm_epsilon,
        initializer_range=cfg.initializer_range, rope_theta=cfg.rope_theta,
        rope_scaling=scaling, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, attention_dropout=cfg.attn_pdrop,
        hidden_act="silu", bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """LlamaForCausalLM state -> megalite's global state (gate and up stacked)."""
    out = {}
    for name, t in hf_sd.items():
        if name.endswith("rotary_emb.inv_freq") or name.endswith(".mlp.up_proj.weight"):
            continue
        if name.endswith(".mlp.gate_proj.weight"):
            prefix = name[:-len(".mlp.gate_proj.weight")]
            up = hf_sd[prefix + ".mlp.up_proj.weight"]
            out[prefix + GATE_UP] = torch.cat([t, up], dim=0)
            continue
        out[name] = t
    return out


def to_hf_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """megalite's global state -> LlamaForCausalLM names (gate and up split)."""
    out = {}
    for name, t in sd.items():
        if name.endswith(GATE_UP):
            gate, up = t.chunk(2, dim=0)
            prefix = name[:-len(GATE_UP)]
            out[prefix + ".mlp.gate_proj.weight"] = gate.contiguous()
            out[prefix + ".mlp.up_proj.weight"] = up.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def rope_of(hf_cfg) -> Tuple[float, Optional[dict]]:
    """(rope_theta, the scaling dict or None) of a LlamaConfig of transformers 4
    (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = getattr(hf_cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        kind = params.get("rope_type", params.get("type", "default"))
        return float(params["rope_theta"]), (dict(params) if kind != "default" else None)
    scaling = getattr(hf_cfg, "rope_scaling", None)
    return float(getattr(hf_cfg, "rope_theta", 10000.0)), scaling


def _scaling(cfg: ModelConfig, theirs: Optional[dict], source: str) -> None:
    if theirs is None:
        if cfg.rope_scaling is not None:
            raise ConfigError(f"model.rope_scaling={asdict(cfg.rope_scaling)}: init_from="
                              f"{source!r} has no RoPE scaling; set model.rope_scaling=null")
        return
    kind = theirs.get("rope_type", theirs.get("type"))
    if kind != "llama3":
        raise ConfigError(f"init_from={source!r}: rope_type={kind!r}, but megalite's Llama "
                          "computes RoPE unscaled or with Llama 3's scaling (rope_type llama3)")
    want = {k: theirs[k] for k in asdict(RopeScaling()) if k in theirs}
    if cfg.rope_scaling is None or any(getattr(cfg.rope_scaling, k) != v
                                       for k, v in want.items()):
        ours = None if cfg.rope_scaling is None else asdict(cfg.rope_scaling)
        raise ConfigError(f"model.rope_scaling={ours}: init_from={source!r} has rope_scaling "
                          f"{want}; use a preset with RoPE scaling (model=llama3.2-1b) and set "
                          "model.rope_scaling.<key> where its values differ")


def check_shape_matches(cfg: ModelConfig, hf_cfg, source: str) -> None:
    """The model config must describe the Llama being loaded; name the first mismatch."""
    for key, field in FIELDS.items():
        ours = cfg.ffn_size if key == "n_inner" else cfg.kv_heads if key == "n_kv_head" \
            else getattr(cfg, key)
        theirs = getattr(hf_cfg, field, None)
        if key == "n_kv_head" and theirs is None:
            theirs = hf_cfg.num_attention_heads
        if ours != theirs:
            raise ConfigError(f"model.{key}={getattr(cfg, key)!r}: init_from={source!r} has "
                              f"{field}={theirs!r}; pick the matching preset or set "
                              f"model.{key}={theirs!r}")
    theta, scaling = rope_of(hf_cfg)
    if cfg.rope_theta != theta:
        raise ConfigError(f"model.rope_theta={cfg.rope_theta!r}: init_from={source!r} has "
                          f"rope_theta={theta!r}; set model.rope_theta={theta!r}")
    _scaling(cfg, scaling, source)
    head_dim = getattr(hf_cfg, "head_dim", None)
    if head_dim is not None and head_dim != cfg.head_size:
        raise ConfigError(f"model.head_dim={cfg.head_dim!r}: init_from={source!r} has "
                          f"head_dim={head_dim} (megalite's: {cfg.head_size}); set "
                          f"model.head_dim={head_dim} where the family takes it (qwen3), or "
                          "pick the matching preset")
    for key, accepted in ARCHITECTURE.items():
        theirs = getattr(hf_cfg, key, accepted[0])
        if theirs not in accepted:
            raise ConfigError(f"init_from={source!r}: {key}={theirs!r}, but megalite's Llama "
                              f"has {key}={accepted[0]!r}; its weights would compute another "
                              "model")


def model_keys(hf_cfg, source: str, arch: str = "llama") -> ModelKeys:
    """The model config of a LlamaConfig (or a config of Llama's fields: Mixtral's, Qwen3's),
    as model.arch `arch`: `init_from` takes the shape from config.json."""
    shape = {key: getattr(hf_cfg, field, None) for key, field in FIELDS.items()}
    if shape["n_kv_head"] is None:
        shape["n_kv_head"] = hf_cfg.num_attention_heads
    theta, scaling = rope_of(hf_cfg)
    known = asdict(RopeScaling())
    shape.update(arch=arch, rope_theta=theta, rope_scaling=None if scaling is None else
                 RopeScaling(**{k: v for k, v in scaling.items() if k in known}))
    defaults = {"attn_pdrop": float(getattr(hf_cfg, "attention_dropout", 0.0)),
                "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "initializer_range": hf_cfg.initializer_range}
    return ModelKeys(shape, defaults)


def derived(name: str) -> bool:
    """A key of the transformers state megalite's state does not hold: a tied head (the token
    embedding; an untied one is in the state), rotary buffers."""
    return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


LLAMA_MAPPING = HFMapping("llama", "LlamaForCausalLM", "Llama", "meta-llama/Llama-3.2-1B",
                          hf_config, to_hf_state_dict, from_hf_state_dict, check_shape_matches,
                          derived, model_keys=model_keys)
