"""Qwen3's and Qwen3-MoE's side of the family interface (`megalite.model.family`): Llama's
(`LlamaFamily`) and Mixtral's (`MixtralFamily`) parameters, counts and rules with two
differences, both flags of the Llama family: an RMSNorm of head_dim weights over each query
and key head (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, transformers' names), and
`model.head_dim` setting the heads' size apart from n_embd / n_head (Qwen3-30B-A3B: hidden 2048,
32 heads of 128). No torchtitan DCP mapping (its Llama 3 has no q/k norms).

The q/k norms' weights are shared by all heads, so under TP each rank's gradient of them is a
partial sum over its own heads: the engine sums TP-replicated gradients over TP under sequence
parallelism (as the block norms' partial sums over the sequence), so tp > 1 needs sp=true
(`tp_partial_weights`, refused by key otherwise).
"""
from __future__ import annotations

from megalite.model.llama.family import LlamaFamily
from megalite.model.mixtral.family import MixtralFamily
from megalite.model.qwen3 import hf as hf_qwen3


class Qwen3Family(LlamaFamily):
    """Llama with q/k norms and its own head_dim (module docstring)."""

    name = "qwen3"
    qk_norm = True
    own_head_dim = True
    tp_partial_weights = True
    hf = hf_qwen3.QWEN3_MAPPING
    dcp = None


class Qwen3MoeFamily(MixtralFamily):
    """Mixtral with q/k norms and its own head_dim (module docstring): every block's MLP an
    MoE layer unless `model.moe.first_dense_layers` / `layer_freq` keep it dense (transformers'
    `mlp_only_layers` / `decoder_sparse_step`), the dense ones of size model.n_inner, the
    experts of model.moe.expert_size."""

    name = "qwen3_moe"
    qk_norm = True
    own_head_dim = True
    tp_partial_weights = True
    hf = hf_qwen3.QWEN3_MOE_MAPPING
    dcp = None


QWEN3_FAMILY = Qwen3Family()
QWEN3_MOE_FAMILY = Qwen3MoeFamily()
