"""Mappings between `transformers.Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` and megalite's
Qwen3 / Qwen3-MoE state (their `HFMapping`s; directories are read and written by
`megalite.model.hf_io`).

Names are transformers' (Llama's, plus `self_attn.q_norm.weight` / `k_norm.weight`), the dense
MLPs' gate and up fused as Llama's (`megalite.model.llama.hf`). Qwen3-MoE's experts are
transformers 5's fused stacks, `mlp.gate.weight` [E, h], `mlp.experts.gate_up_proj`
[E, 2I, h], `mlp.experts.down_proj` [E, h, I]; the per-expert layout of the hub's checkpoints
and of transformers 4 (`mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`) is stacked on the
way in. Which blocks are MoE: transformers' `(i + 1) % decoder_sparse_step == 0 and i not in
mlp_only_layers`, megalite's `model.moe.first_dense_layers` / `layer_freq`; a config whose
pattern those two cannot give is refused, and the export writes the pattern as
`mlp_only_layers` (decoder_sparse_step 1).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.model.family import HFMapping, ModelKeys
from megalite.model.llama import hf as hf_llama
from megalite.model.moe.hf_experts import stack_per_expert

PER_EXPERT = re.compile(r"(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# model.moe.<key>: the value Qwen3MoeForCausalLM's routing has
ROUTER = {"score": "softmax", "scaling_factor": 1.0, "n_groups": 1, "bias_update_rate": 0.0,
          "shared_experts": 0}


def _rope(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {**cfg.rope_scaling.__dict__, "rope_theta": cfg.rope_theta}


def _common(cfg: ModelConfig, bos_token_id, eos_token_id) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
        max_position_embeddings=cfg.n_positions, rms_norm_eps=cfg.layer_norm_epsilon,
        initializer_range=cfg.initializer_range, rope_parameters=_rope(cfg),
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False,
        attention_dropout=cfg.attn_pdrop, hidden_act="silu", use_sliding_window=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def hf_config(cfg: ModelConfig, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None):
    """The `transformers.Qwen3Config` of a model shape."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(cfg, bos_token_id, eos_token_id))


def hf_moe_config(cfg: ModelConfig, bos_token_id: Optional[int] = None,
                  eos_token_id: Optional[int] = None):
    """The `transformers.Qwen3MoeConfig` of a model shape (aux loss: model.moe's
    coefficient; the dense blocks as mlp_only_layers)."""
    from transformers import Qwen3MoeConfig

    moe = cfg.moe
    return Qwen3MoeConfig(
        **_common(cfg, bos_token_id, eos_token_id),
        moe_intermediate_size=moe.expert_hidden(cfg.ffn_size), num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, norm_topk_prob=moe.normalize_top_k,
        decoder_sparse_step=1, router_aux_loss_coef=moe.aux_loss_coeff,
        mlp_only_layers=[i for i in range(cfg.n_layer) if not moe.is_moe_layer(i)])


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Qwen3(Moe)ForCausalLM state (either expert layout) -> megalite's global state."""
    return hf_llama.from_hf_state_dict(stack_per_expert(
        hf_sd, PER_EXPERT, ("gate_proj", "up_proj", "down_proj")))


def moe_layers(hf_cfg) -> List[int]:
    """The blocks transformers' Qwen3-MoE makes sparse."""
    step, dense = hf_cfg.decoder_sparse_step, set(hf_cfg.mlp_only_layers or ())
    return [i for i in range(hf_cfg.num_hidden_layers)
            if i not in dense and hf_cfg.num_experts > 0 and (i + 1) % step == 0]


def layer_pattern(hf_cfg, source: str):
    """(first_dense_layers, layer_freq) giving transformers' MoE blocks, or a ConfigError."""
    layers, n = moe_layers(hf_cfg), hf_cfg.num_hidden_layers
    if layers:
        first = layers[0]
        freq = layers[1] - first if len(layers) > 1 else max(1, n - first)
        if layers == list(range(first, n, freq)):
            return first, freq
    raise ConfigError(f"init_from={source!r}: its MoE blocks {layers} (decoder_sparse_step="
                      f"{hf_cfg.decoder_sparse_step}, mlp_only_layers={hf_cfg.mlp_only_layers}) "
                      "are not first_dense_layers dense blocks then every layer_freq-th: "
                      "megalite's model.moe cannot place them")


def check_config(cfg: ModelConfig, hf_cfg, source: str) -> None:
    """The model config must describe the Qwen3 being loaded; name the first mismatch."""
    hf_llama.check_shape_matches(cfg, hf_cfg, source)
    if getattr(hf_cfg, "use_sliding_window", False):
        raise ConfigError(f"init_from={source!r}: use_sliding_window=True, but megalite's "
                          "Qwen3 attends to the whole window")


def _moe_mismatch(key: str, ours, theirs, field: str, source: str) -> ConfigError:
    return ConfigError(f"model.moe.{key}={ours!r}: init_from={source!r} has {field}="
                       f"{theirs!r}; set model.moe.{key}={theirs!r}")


def check_moe_config(cfg: ModelConfig, hf_cfg, source: str) -> None:
    """check_config's, and the experts, the router and the MoE blocks' places."""
    check_config(cfg, hf_cfg, source)
    moe = cfg.moe
    first, freq = layer_pattern(hf_cfg, source)
    theirs = {"num_experts": (hf_cfg.num_experts, "num_experts"),
              "top_k": (hf_cfg.num_experts_per_tok, "num_experts_per_tok"),
              "normalize_top_k": (hf_cfg.norm_topk_prob, "norm_topk_prob"),
              "first_dense_layers": (first, "mlp_only_layers / decoder_sparse_step"),
              "layer_freq": (freq, "mlp_only_layers / decoder_sparse_step")}
    for key, (value, field) in theirs.items():
        if getattr(moe, key) != value:
            raise _moe_mismatch(key, getattr(moe, key), value, field, source)
    if moe.expert_hidden(cfg.ffn_size) != hf_cfg.moe_intermediate_size:
        raise _moe_mismatch("expert_size", moe.expert_size, hf_cfg.moe_intermediate_size,
                            "moe_intermediate_size", source)
    for key, value in ROUTER.items():
        if getattr(moe, key) != value:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)!r}: Qwen3MoeForCausalLM "
                              f"(init_from={source!r}) has model.moe.{key}={value!r}; its "
                              "weights would compute another model")


def check_moe_export(cfg: ModelConfig) -> None:
    """A model Qwen3MoeForCausalLM computes: its routing (no selection bias, which the export
    would drop, no shared experts)."""
    for key, value in ROUTER.items():
        if getattr(cfg.moe, key) != value:
            raise ConfigError(f"model.moe.{key}={getattr(cfg.moe, key)!r}: "
                              f"Qwen3MoeForCausalLM has model.moe.{key}={value!r} and cannot "
                              "hold this model; a megalite checkpoint holds it "
                              "(checkpoint.resume)")


def model_keys(hf_cfg, source: str) -> ModelKeys:
    """The model config of a Qwen3Config: Llama's keys and the head size."""
    keys = hf_llama.model_keys(hf_cfg, source, "qwen3")
    keys.shape["head_dim"] = getattr(hf_cfg, "head_dim", None) \
        or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    return keys


def moe_model_keys(hf_cfg, source: str) -> ModelKeys:
    """The model config of a Qwen3MoeConfig: Qwen3's keys, the experts, their router and
    places (a pattern megalite cannot place: a ConfigError naming it)."""
    keys = model_keys(hf_cfg, source)
    first, freq = layer_pattern(hf_cfg, source)
    keys.shape.update({"arch": "qwen3_moe", "moe.num_experts": hf_cfg.num_experts,
                       "moe.top_k": hf_cfg.num_experts_per_tok,
                       "moe.expert_size": hf_cfg.moe_intermediate_size,
                       "moe.normalize_top_k": hf_cfg.norm_topk_prob,
                       "moe.first_dense_layers": first, "moe.layer_freq": freq,
                       **{f"moe.{k}": v for k, v in ROUTER.items()}})
    keys.defaults["moe.aux_loss_coeff"] = hf_cfg.router_aux_loss_coef
    return keys


QWEN3_MAPPING = HFMapping("qwen3", "Qwen3ForCausalLM", "Qwen3", "Qwen/Qwen3-0.6B", hf_config,
                          hf_llama.to_hf_state_dict, from_hf_state_dict, check_config,
                          hf_llama.derived, model_keys=model_keys)
QWEN3_MOE_MAPPING = HFMapping("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE",
                              "Qwen/Qwen3-30B-A3B", hf_moe_config, hf_llama.to_hf_state_dict,
                              from_hf_state_dict, check_moe_config, hf_llama.derived,
                              check_moe_export, moe_model_keys)
