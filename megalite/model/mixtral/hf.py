"""Mapping between `transformers.MixtralForCausalLM` and megalite's Mixtral state (Mixtral's
`HFMapping`; directories are read and written by `megalite.model.hf_io`).

megalite's names are transformers 5's: attention and norms as Llama's, the router
`mlp.gate.weight` [E, h], the experts fused and stacked, `mlp.experts.gate_up_proj` [E, 2I, h]
([w1 | w3] of each expert) and `mlp.experts.down_proj` [E, h, I] (w2). Both layouts are read:
that one, and the per-expert layout of the hub's Mixtral checkpoints and of transformers 4
(`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.<e>.w1/w2/w3.weight`), stacked
on the way in. The state written is transformers 5's layout (the model class's own names;
`save_pretrained` writes what that version writes).

`check_config` holds a MixtralConfig to the model config: Llama's shape and RoPE checks, the
experts' number, size and top-k, and the router MixtralForCausalLM computes (softmax, top-k
renormalised, no bias, no groups, no shared experts, every block MoE, no sliding window).
"""
from __future__ import annotations

import re
from typing import Dict, Optional

import torch

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.model.family import HFMapping, ModelKeys
from megalite.model.llama import hf as hf_llama
from megalite.model.moe.hf_experts import stack_per_expert

PER_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
# model.moe.<key>: the value MixtralForCausalLM's routing has
ROUTER = {"score": "softmax", "normalize_top_k": True, "scaling_factor": 1.0, "n_groups": 1,
          "bias_update_rate": 0.0, "shared_experts": 0, "first_dense_layers": 0,
          "layer_freq": 1, "expert_size": None}


def hf_config(cfg: ModelConfig, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None):
    """The `transformers.MixtralConfig` of a model shape (aux loss: model.moe's coefficient)."""
    from transformers import MixtralConfig

    moe = cfg.moe
    return MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
        intermediate_size=moe.expert_hidden(cfg.ffn_size), num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size, max_position_embeddings=cfg.n_positions,
        rms_norm_eps=cfg.layer_norm_epsilon, initializer_range=cfg.initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, attention_dropout=cfg.attn_pdrop,
        hidden_act="silu", sliding_window=None, num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coeff,
        router_jitter_noise=0.0, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """MixtralForCausalLM state (either layout) -> megalite's global state."""
    stacked = stack_per_expert(hf_sd, PER_EXPERT, ("w1", "w3", "w2"),
                               lambda n: n.replace(".block_sparse_moe.", ".mlp."))
    return {name: t for name, t in stacked.items() if not name.endswith("rotary_emb.inv_freq")}


def to_hf_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """megalite's global state -> MixtralForCausalLM (transformers 5) names: the same."""
    return {name: t.contiguous() for name, t in sd.items()}


def check_config(cfg: ModelConfig, hf_cfg, source: str) -> None:
    """The model config must describe the Mixtral being loaded; name the first mismatch."""
    hf_llama.check_shape_matches(cfg, hf_cfg, source)
    moe = cfg.moe
    for key, field in (("num_experts", "num_local_experts"), ("top_k", "num_experts_per_tok")):
        theirs = getattr(hf_cfg, field)
        if getattr(moe, key) != theirs:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)!r}: init_from={source!r} has "
                              f"{field}={theirs!r}; set model.moe.{key}={theirs!r}")
    for key, value in ROUTER.items():
        if getattr(moe, key) != value:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)!r}: MixtralForCausalLM "
                              f"(init_from={source!r}) has model.moe.{key}={value!r}; its "
                              "weights would compute another model")
    if getattr(hf_cfg, "sliding_window", None) is not None:
        raise ConfigError(f"init_from={source!r}: sliding_window={hf_cfg.sliding_window}, but "
                          "megalite's Mixtral attends to the whole window (sliding_window=null)")
    if getattr(hf_cfg, "router_jitter_noise", 0.0):
        raise ConfigError(f"init_from={source!r}: router_jitter_noise="
                          f"{hf_cfg.router_jitter_noise}, megalite's router has no jitter")


def check_export(cfg: ModelConfig) -> None:
    """A model MixtralForCausalLM computes: its routing (no selection bias, which the
    export would drop, no shared experts, every block MoE)."""
    for key, value in ROUTER.items():
        if getattr(cfg.moe, key) != value:
            raise ConfigError(f"model.moe.{key}={getattr(cfg.moe, key)!r}: MixtralForCausalLM "
                              f"has model.moe.{key}={value!r} and cannot hold this model; "
                              "a megalite checkpoint holds it (checkpoint.resume)")


def model_keys(hf_cfg, source: str) -> ModelKeys:
    """The model config of a MixtralConfig: Llama's keys, the experts and Mixtral's router."""
    keys = hf_llama.model_keys(hf_cfg, source, "mixtral")
    keys.shape.update({"moe.num_experts": hf_cfg.num_local_experts,
                       "moe.top_k": hf_cfg.num_experts_per_tok,
                       **{f"moe.{k}": v for k, v in ROUTER.items()}})
    keys.defaults["moe.aux_loss_coeff"] = hf_cfg.router_aux_loss_coef
    return keys


def derived(name: str) -> bool:
    """A tied head (the token embedding) and rotary buffers."""
    return hf_llama.derived(name)


MIXTRAL_MAPPING = HFMapping("mixtral", "MixtralForCausalLM", "Mixtral",
                            "mistralai/Mixtral-8x7B-v0.1", hf_config, to_hf_state_dict,
                            from_hf_state_dict, check_config, derived, check_export,
                            model_keys)
