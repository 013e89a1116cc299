"""The `model.moe` section: a Mixture-of-Experts layer's router, experts, balancing and capacity
(the layer: `megalite.model.moe`; the page: docs/moe.md). A model with `num_experts = 0` is
dense; a family that has MoE layers (model.arch=mixtral) needs `num_experts >= 1`.

The rules a setting keeps by itself are `MoEConfig.check`'s; those between MoE and the layout
(what MoE does not run with yet) are `check_layout`'s, both before launch, each naming its key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.errors import fail

SCORES = ("softmax", "sigmoid")
AUX_LOSSES = ("layer", "sequence", "hf")
DROP_POLICIES = ("probs", "position")
EXPERT_IMPLS = ("auto", "grouped", "loop")


@dataclass
class MoEConfig:
    """A Mixture-of-Experts layer (docs/moe.md). Field by field:

    num_experts: routed experts per MoE layer (transformers' num_local_experts); 0 = dense.
    top_k: experts each token is sent to (num_experts_per_tok); 1 <= top_k <= num_experts.
    expert_size: each routed expert's SwiGLU hidden size (moe_intermediate_size); None =
        model.n_inner (Mixtral's experts are full-size MLPs).
    score: the router's scores: softmax over all experts (Mixtral, Qwen3-MoE, OLMoE) or
        sigmoid per expert (DeepSeek-V3), computed in fp32.
    normalize_top_k: divide the k chosen scores by their sum (Mixtral yes, OLMoE no,
        Qwen3-MoE per norm_topk_prob, DeepSeek-V3 yes).
    scaling_factor: the k weights are multiplied by it (DeepSeek-V3's routed_scaling_factor).
    n_groups: expert groups of group-limited routing (DeepSeek-V3's n_group); 1 = none.
    top_groups: groups a token may choose from, ranked by the sum of their top-2 scores
        (topk_group).
    bias_update_rate: the aux-loss-free balancing bias (DeepSeek-V3's
        e_score_correction_bias): added to the scores to choose, never to weigh; after each
        optimizer step bias += rate * sign(mean count - count). 0 = no bias.
    aux_loss: the balancing loss: layer (Switch / Megatron: E * sum_e f_e * P_e per layer,
        f_e = tokens to e / (k * T)), sequence (the same per sequence, averaged; DeepSeek-V3's
        sequence-wise loss) or hf (transformers' value: all layers' routing pooled into one
        E * sum f * P, f = tokens to e / T, added once).
    aux_loss_coeff: the aux loss's coefficient (transformers' router_aux_loss_coef); 0 = off.
    z_loss_coeff: the router z-loss's coefficient (ST-MoE: mean of logsumexp(logits)^2).
    capacity_factor: each expert takes at most ceil(factor * k * T / E) of a micro-batch's
        assignments, the others dropped (counted); None = dropless.
    drop_policy: which assignments an over-full expert drops: probs (the lowest routing
        weights) or position (the latest tokens).
    shared_experts: dense SwiGLU experts every token passes (DeepSeek-V3, Qwen2-MoE); 0 = none.
    shared_expert_size: their hidden size together; None = expert_size * shared_experts.
    shared_expert_gate: scale the shared experts' output by sigmoid(x . w) (Qwen2-MoE).
    first_dense_layers: the first blocks keep a dense MLP (DeepSeek-V3: 3).
    layer_freq: after those, every layer_freq-th block is MoE, the others dense.
    experts_impl: auto (torch._grouped_mm where it takes the shapes, else a per-expert loop),
        grouped or loop; the same numbers either way.
    """

    num_experts: int = 0
    top_k: int = 2
    expert_size: Optional[int] = None
    score: str = "softmax"
    normalize_top_k: bool = True
    scaling_factor: float = 1.0
    n_groups: int = 1
    top_groups: int = 1
    bias_update_rate: float = 0.0
    aux_loss: str = "layer"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    shared_experts: int = 0
    shared_expert_size: Optional[int] = None
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    layer_freq: int = 1
    experts_impl: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def has_bias(self) -> bool:
        """The router holds a selection bias (sigmoid scores, as DeepSeek-V3, or a bias that
        is updated)."""
        return self.score == "sigmoid" or self.bias_update_rate > 0

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` has an MoE layer (else a dense MLP)."""
        return index >= self.first_dense_layers \
            and (index - self.first_dense_layers) % self.layer_freq == 0

    def check(self) -> None:
        """Each setting by itself (ConfigError naming the key)."""
        choices = (("score", SCORES), ("aux_loss", AUX_LOSSES), ("drop_policy", DROP_POLICIES),
                   ("experts_impl", EXPERT_IMPLS))
        for key, allowed in choices:
            if getattr(self, key) not in allowed:
                fail(f"model.moe.{key}", getattr(self, key), f"use one of {', '.join(allowed)}")
        if self.num_experts < 0:
            fail("model.moe.num_experts", self.num_experts, "must be >= 0 (0: a dense model)")
        if not self.enabled:
            return
        e = self.num_experts
        if not 1 <= self.top_k <= e:
            fail("model.moe.top_k", self.top_k, f"must be between 1 and model.moe.num_experts"
                 f"={e} (the experts a token is sent to)")
        if self.n_groups < 1 or e % self.n_groups:
            fail("model.moe.n_groups", self.n_groups, f"must divide model.moe.num_experts={e} "
                 "(experts are grouped evenly); 1 = no group-limited routing")
        if self.n_groups > 1:
            self._check_groups()
        elif self.top_groups != 1:
            fail("model.moe.top_groups", self.top_groups,
                 "only applies with model.moe.n_groups > 1 (group-limited routing); leave it 1")
        if self.aux_loss == "hf" and (self.score != "softmax" or self.bias_update_rate > 0):
            fail("model.moe.aux_loss", "hf", "transformers' pooled value is of softmax routing "
                 "without a selection bias: set model.moe.score=softmax and "
                 "bias_update_rate=0, or use aux_loss=layer or sequence")
        if self.shared_experts == 0 and (self.shared_expert_gate
                                         or self.shared_expert_size is not None):
            key = "shared_expert_gate" if self.shared_expert_gate else "shared_expert_size"
            fail(f"model.moe.{key}", getattr(self, key),
                 "only applies with model.moe.shared_experts >= 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            fail("model.moe.capacity_factor", self.capacity_factor,
                 "must be > 0 (1.25 is common), or null for dropless experts")
        for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if not getattr(self, key) >= 0:
                fail(f"model.moe.{key}", getattr(self, key), "must be >= 0 (0: off)")
        if not self.scaling_factor > 0:
            fail("model.moe.scaling_factor", self.scaling_factor, "must be > 0 (1: none)")
        for key in ("expert_size", "shared_expert_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                fail(f"model.moe.{key}", getattr(self, key), "must be a positive integer or null")
        if self.shared_experts < 0:
            fail("model.moe.shared_experts", self.shared_experts, "must be >= 0 (0: none)")
        if self.first_dense_layers < 0 or self.layer_freq < 1:
            key = "first_dense_layers" if self.first_dense_layers < 0 else "layer_freq"
            fail(f"model.moe.{key}", getattr(self, key), "first_dense_layers must be >= 0 and "
                 "layer_freq >= 1")

    def _check_groups(self) -> None:
        per_group = self.num_experts // self.n_groups
        if per_group < 2:
            fail("model.moe.n_groups", self.n_groups, f"leaves {per_group} expert a group; a "
                 "group is ranked by its top-2 scores, so each needs at least 2")
        if not 1 <= self.top_groups <= self.n_groups:
            fail("model.moe.top_groups", self.top_groups,
                 f"must be between 1 and model.moe.n_groups={self.n_groups}")
        if self.top_k > self.top_groups * per_group:
            fail("model.moe.top_k", self.top_k, f"is more than the {self.top_groups} chosen "
                 f"groups' {self.top_groups * per_group} experts; raise model.moe.top_groups")

    def expert_hidden(self, n_inner: int) -> int:
        return self.expert_size if self.expert_size is not None else n_inner

    def shared_hidden(self, n_inner: int) -> int:
        if self.shared_expert_size is not None:
            return self.shared_expert_size
        return self.expert_hidden(n_inner) * self.shared_experts


def check_layout(cfg) -> None:
    """What MoE does not run with yet (a `Config` whose model.moe is enabled), each refused by
    its key before launch: the layouts and features not yet made equal to the serial run
    with MoE layers (docs/moe.md, docs/support-matrix.md)."""
    moe = cfg.model.moe
    if not moe.enabled:
        return
    why = f"MoE (model.moe.num_experts={moe.num_experts}) does not support"
    _check_token_split(cfg, moe)
    if cfg.pp > 1 and moe.aux_loss == "hf":
        fail("model.moe.aux_loss", "hf", "transformers' pooled value is one term of every "
             f"layer's routing, which a pipeline (pp={cfg.pp}, parallel.schedule="
             f"{cfg.parallel.schedule}) does not hold on one stage; use aux_loss=layer or "
             "sequence, or pp=1")
    if cfg.fp8.recipe == "rowwise":
        fail("fp8.recipe", "rowwise", f"{why} rowwise FP8 on its experts yet (tensorwise: one "
             "scale per expert weight and per expert input); use fp8.recipe=tensorwise or none")
    if cfg.train.compile:
        fail("train.compile", True, f"{why} torch.compile yet: the experts are not traced "
             "(torch._grouped_mm's compiled kernel takes bf16 only, and each expert's token "
             "count is data-dependent); set train.compile=false")


def _check_token_split(cfg, moe: MoEConfig) -> None:
    """TP and CP with MoE (`megalite.model.moe.tokens`): the router runs on each rank's own
    tokens, so tp > 1 needs them split (sp); TP splits every expert's SwiGLU and the shared
    experts' as the dense MLP; a capacity is a micro-batch's, whose tokens CP splits."""
    if cfg.tp > 1 and not cfg.sp:
        fail("sp", cfg.sp, f"MoE (model.moe.num_experts={moe.num_experts}) with tp={cfg.tp} "
             "needs sp=true: each TP rank routes its own tokens (sequence parallelism), the "
             "experts see them all")
    for key, size in (("expert_size", moe.expert_hidden(cfg.model.ffn_size)),
                      ("shared_expert_size", moe.shared_hidden(cfg.model.ffn_size)
                       if moe.shared_experts else 0)):
        if size % cfg.tp:
            fail("tp", cfg.tp, f"must divide the MoE layer's model.moe.{key} ({size}): TP "
                 "splits each expert's SwiGLU as the dense MLP's")
    if cfg.cp > 1 and moe.capacity_factor is not None:
        fail("model.moe.capacity_factor", moe.capacity_factor, f"is refused with cp={cfg.cp}: "
             "an expert's capacity is a micro-batch's, whose tokens CP splits over its ranks "
             "(each would cap its own share, not the serial run's); use capacity_factor=null "
             "(dropless) or cp=1")
