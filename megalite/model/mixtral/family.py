"""Mixtral's side of the family interface (`megalite.model.family`): Llama's attention, norms,
embeddings and rules (`LlamaFamily`) with an MoE layer (`model.moe`) in place of the MLP of
every block `model.moe.is_moe_layer` names (all of them in Mixtral; the others keep Llama's
dense SwiGLU). Parameter names are transformers 5's MixtralForCausalLM's: `mlp.gate.weight`
[E, h], `mlp.experts.gate_up_proj` [E, 2I, h], `mlp.experts.down_proj` [E, h, I].

Counts: `num_parameters` every parameter (all experts); `active_parameters` those a token
passes through (the router, k routed experts, the shared experts: what FLOPs, MFU and the time
model count, Megatron's and torchtitan's convention).
"""
from __future__ import annotations

from typing import List

from megalite.config.errors import fail
from megalite.config.families import Fp8Linear
from megalite.config.schema import ModelConfig
from megalite.model.family import Specs
from megalite.model.llama.family import LlamaFamily
from megalite.model.mixtral import hf as hf_mixtral
from megalite.parallel.param_spec import ParamSpec

DENSE_MLP = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def moe_specs(cfg: ModelConfig, prefix: str) -> Specs:
    """The MoE layer's parameters (`megalite.model.moe.layer`): the router and the shared
    experts' gate replicated over TP, each expert's [gate | up] split by rows (each block
    split: `tp_interleave=2`, as the dense MLP's) and its down projection by columns, the
    shared experts' likewise; the routed experts' split over EP (`ParamSpec.expert`)."""
    moe, h = cfg.moe, cfg.n_embd
    e, i = moe.num_experts, moe.expert_hidden(cfg.ffn_size)
    shapes = [("mlp.gate.weight", (e, h), {}),
              ("mlp.experts.gate_up_proj", (e, 2 * i, h), {"tp_dim": 1, "tp_interleave": 2}),
              ("mlp.experts.down_proj", (e, h, i), {"tp_dim": 2})]
    if moe.shared_experts:
        s = moe.shared_hidden(cfg.ffn_size)
        shapes += [("mlp.shared_experts.gate_up_proj.weight", (2 * s, h),
                    {"tp_dim": 0, "tp_interleave": 2}),
                   ("mlp.shared_experts.down_proj.weight", (h, s), {"tp_dim": 1})]
        if moe.shared_expert_gate:
            shapes.append(("mlp.shared_experts_gate.weight", (1, h), {}))
    return [(prefix + n, ParamSpec(prefix + n, shape, expert=n.startswith("mlp.experts."),
                                   **split))
            for n, shape, split in shapes]


class MixtralFamily(LlamaFamily):
    """Llama's blocks with MoE layers (module docstring)."""

    name = "mixtral"
    mixture_of_experts = True
    hf = hf_mixtral.MIXTRAL_MAPPING

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        if not any(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layer)):
            fail("model.moe.first_dense_layers", cfg.moe.first_dense_layers,
                 f"leaves no MoE layer among the model's {cfg.n_layer} blocks")

    def block_specs(self, cfg: ModelConfig, index: int, tp: int) -> Specs:
        specs = super().block_specs(cfg, index, tp)
        if not cfg.moe.is_moe_layer(index):
            return specs
        p = f"model.layers.{index}."
        return [s for s in specs if s[0][len(p):] not in DENSE_MLP] + moe_specs(cfg, p)

    def fp8_linears(self, cfg: ModelConfig, tp: int) -> List[Fp8Linear]:
        """o_proj, the dense blocks' MLP (where `first_dense_layers` / `layer_freq` leave
        some) and each routed expert's two products (`megalite.model.moe.fp8_experts`; one
        expert's weight at `tp`: the products run expert by expert). The router and the shared
        experts stay in the model dtype."""
        llama = super().fp8_linears(cfg, tp)
        dense = any(not cfg.moe.is_moe_layer(i) for i in range(cfg.n_layer))
        h, i = cfg.n_embd, cfg.moe.expert_hidden(cfg.ffn_size)
        experts = [("model.layers.*.mlp.experts.gate_up_proj", "model.n_embd", h,
                    "2 * model.moe.expert_size / tp", 2 * i // tp),
                   ("model.layers.*.mlp.experts.down_proj", "model.moe.expert_size / tp",
                    i // tp, "model.n_embd", h)]
        return (llama if dense else llama[:1]) + experts

    def fp8_linear_parameters(self, cfg: ModelConfig) -> int:
        """A block's weights a token passes in FP8, averaged over the blocks: o_proj, the dense
        MLP of the dense blocks, the top_k routed experts of the MoE blocks."""
        h, a = cfg.n_embd, cfg.n_head * cfg.head_size
        moe_blocks = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layer))
        experts = moe_blocks * cfg.moe.top_k * 3 * h * cfg.moe.expert_hidden(cfg.ffn_size)
        dense = (cfg.n_layer - moe_blocks) * 3 * h * cfg.ffn_size
        return a * h + (experts + dense) // cfg.n_layer

    # --- counts ---------------------------------------------------------------------------

    def _mlp_parameters(self, cfg: ModelConfig, active: bool) -> int:
        moe, h = cfg.moe, cfg.n_embd
        experts = moe.top_k if active else moe.num_experts
        shared = 3 * h * moe.shared_hidden(cfg.ffn_size) if moe.shared_experts else 0
        gate = h if moe.shared_expert_gate and moe.shared_experts else 0
        return moe.num_experts * h + experts * 3 * h * moe.expert_hidden(cfg.ffn_size) \
            + shared + gate

    def _blocks(self, cfg: ModelConfig, active: bool) -> int:
        """All blocks' parameters (every expert, or those a token passes: `active`)."""
        dense = super().block_parameters(cfg)
        moe_blocks = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layer))
        dense_mlp = 3 * cfg.n_embd * cfg.ffn_size
        return cfg.n_layer * dense + moe_blocks * (self._mlp_parameters(cfg, active) - dense_mlp)

    def block_parameters(self, cfg: ModelConfig) -> int:
        """A block's active parameters, averaged over the blocks (the time model's 2·P)."""
        return self._blocks(cfg, active=True) // cfg.n_layer

    def block_parameters_of(self, cfg: ModelConfig, index: int) -> int:
        """Block `index`'s active parameters: Llama's dense block, or with its MoE layer's
        router, top-k routed and shared experts in place of the MLP."""
        dense = super().block_parameters(cfg)
        if not cfg.moe.is_moe_layer(index):
            return dense
        return dense - 3 * cfg.n_embd * cfg.ffn_size + self._mlp_parameters(cfg, active=True)

    def num_parameters(self, cfg: ModelConfig) -> int:
        vh = cfg.vocab_size * cfg.n_embd
        return self._blocks(cfg, active=False) + cfg.n_embd + vh \
            + (0 if cfg.tie_word_embeddings else vh)

    def active_parameters(self, cfg: ModelConfig) -> int:
        vh = cfg.vocab_size * cfg.n_embd
        return self._blocks(cfg, active=True) + cfg.n_embd + vh \
            + (0 if cfg.tie_word_embeddings else vh)

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        """6N + 12·L·h·s with N the active parameters but the token embedding's lookup."""
        n = self._blocks(cfg, active=True) + cfg.n_embd + cfg.vocab_size * cfg.n_embd
        return 6 * n + self.attention_flops_per_pair(cfg) * seq_len

    def flops_formula(self) -> str:
        return ("6N + 12*L*h*s (N = active parameters: router, top-k routed and shared "
                "experts, attention, norms, LM head; not the token embedding's lookup)")

    def layer_activation_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, sp: bool,
                               e: int, dropout: bool = False,
                               math_attention: bool = False) -> float:
        """An MoE block's bytes (`block_activation_bytes` at ep = 1)."""
        base = super().layer_activation_bytes(cfg, s, b, t, sp, e, dropout, math_attention)
        return base - 4 * e * s * b * cfg.ffn_size / t \
            + self.moe_layer_bytes(cfg, s, b, t, sp, e, folded=False)

    def block_activation_bytes(self, cfg: ModelConfig, index: int, s: int, b: int, t: int,
                               sp: bool, e: int, dropout: bool = False,
                               math_attention: bool = False, ep: int = 1) -> float:
        """Llama's block without its MLP terms, plus the MoE layer's (`moe_layer_bytes`);
        a block `model.moe.is_moe_layer` leaves dense: Llama's."""
        base = super().layer_activation_bytes(cfg, s, b, t, sp, e, dropout, math_attention)
        if not cfg.moe.is_moe_layer(index):
            return base
        return base - 4 * e * s * b * cfg.ffn_size / t \
            + self.moe_layer_bytes(cfg, s, b, t, sp, e, folded=ep > 1 and t > 1 and sp)

    @staticmethod
    def moe_layer_bytes(cfg: ModelConfig, s: int, b: int, t: int, sp: bool, e: int,
                        folded: bool) -> float:
        """What an MoE layer saves (`megalite.model.moe.layer`), on T tokens of I-wide
        experts: the router's fp32 logits and scores on this rank's s'b tokens (8·s'b·E,
        s' = s/t under SP), the k weights and three int64 index tensors of the assignments
        (28·T·k); per assignment the dispatched row, [gate | up], silu(gate), the SwiGLU
        product, the expert's output and the weighted output (index_add_ keeps its source),
        k·e·T·(3h + 4I); the shared experts' [gate | up], silu and product, 4·e·sb·S/t,
        their input gathered over TP (e·sb·h where t > 1), and with their gate its output
        and theirs, e·sb·(h + 1). TP-split experts (`folded` false) run on the sb tokens
        gathered over TP, I = expert_size/t; EP folded over TP (ep > 1, t > 1, SP) runs each
        whole expert (I = expert_size) on the rank's own T = s'b tokens, the rows it
        receives as many as it sends under balanced routing."""
        moe, tokens, h = cfg.moe, s * b, cfg.n_embd
        local = tokens // t if sp else tokens
        rows = local if folded else tokens
        i = moe.expert_hidden(cfg.ffn_size) / (1 if folded else t)
        out = 8 * local * moe.num_experts + 28 * rows * moe.top_k \
            + e * rows * moe.top_k * (3 * h + 4 * i)
        if moe.shared_experts:
            out += 4 * e * tokens * moe.shared_hidden(cfg.ffn_size) / t \
                + (e * tokens * h if t > 1 else 0) \
                + (e * tokens * (h + 1) if moe.shared_expert_gate else 0)
        return out

    def block_backward_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, e: int) -> float:
        return 2 * e * s * b * cfg.moe.top_k * cfg.moe.expert_hidden(cfg.ffn_size) / t

    def block_backward_bytes_of(self, cfg: ModelConfig, index: int, s: int, b: int, t: int,
                                e: int, sp: bool = False, ep: int = 1) -> float:
        """The SwiGLU's gradients of [gate | up]: a dense block's Llama's; an MoE block's
        2·e·T·k·I (`moe_layer_bytes`' T and I)."""
        if not cfg.moe.is_moe_layer(index):
            return super().block_backward_bytes(cfg, s, b, t, e)
        if ep > 1 and t > 1 and sp:
            return 2 * e * (s // t) * b * cfg.moe.top_k * cfg.moe.expert_hidden(cfg.ffn_size)
        return self.block_backward_bytes(cfg, s, b, t, e)


MIXTRAL_FAMILY = MixtralFamily()
