"""Qwen3's and Qwen3-MoE's side of the family interface (`megalite.model.family`): Llama's
(`LlamaFamily`) and Mixtral's (`MixtralFamily`) parameters, counts and rules with two
differences, both flags of the Llama family: an RMSNorm of head_dim weights over each query
and key head (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, transformers' names), and
`model.head_dim` setting the heads' size apart from n_embd / n_head (Qwen3-30B-A3B: hidden 2048,
32 heads of 128). No torchtitan DCP mapping (its Llama 3 has no q/k norms).

The q/k norms' weights are shared by all heads, so under TP each rank's gradient of them is a
partial sum over its own heads: until the engine sums such replicated-weight gradients over TP,
tp > 1 is refused by key (`check_tp`).
"""
from __future__ import annotations

from megalite.config.errors import fail
from megalite.config.schema import ModelConfig
from megalite.model.llama.family import LlamaFamily
from megalite.model.mixtral.family import MixtralFamily
from megalite.model.qwen3 import hf as hf_qwen3


def _check_tp(name: str, tp: int) -> None:
    if tp > 1:
        fail("tp", tp, f"model.arch={name} does not support tp > 1 yet (its q/k norm weights "
             "are shared by heads that TP splits, their gradients not yet summed over TP); "
             "use tp=1")


class Qwen3Family(LlamaFamily):
    """Llama with q/k norms and its own head_dim (module docstring)."""

    name = "qwen3"
    qk_norm = True
    own_head_dim = True
    hf = hf_qwen3.QWEN3_MAPPING
    dcp = None

    def check_tp(self, cfg: ModelConfig, tp: int) -> None:
        super().check_tp(cfg, tp)
        _check_tp(self.name, tp)


class Qwen3MoeFamily(MixtralFamily):
    """Mixtral with q/k norms and its own head_dim (module docstring): every block's MLP an
    MoE layer unless `model.moe.first_dense_layers` / `layer_freq` keep it dense (transformers'
    `mlp_only_layers` / `decoder_sparse_step`), the dense ones of size model.n_inner, the
    experts of model.moe.expert_size."""

    name = "qwen3_moe"
    qk_norm = True
    own_head_dim = True
    hf = hf_qwen3.QWEN3_MOE_MAPPING
    dcp = None

    def check_tp(self, cfg: ModelConfig, tp: int) -> None:
        super().check_tp(cfg, tp)
        _check_tp(self.name, tp)


QWEN3_FAMILY = Qwen3Family()
QWEN3_MOE_FAMILY = Qwen3MoeFamily()
