"""Llama's side of the family interface (`megalite.model.family`): its parameters (names and
TP splits of `transformers.LlamaForCausalLM`, gate and up fused), initialisation, FLOPs and
activation terms. The modules are `megalite.model.llama.stage`, the mappings
`megalite.model.llama.hf` (transformers) and `megalite.model.llama.titan` (torchtitan's DCP
names)."""
from __future__ import annotations

from typing import List, Tuple

from megalite.config.errors import fail
from megalite.config.families import Fp8Linear
from megalite.config.schema import ModelConfig
from megalite.model.family import Family, Initial, Specs, attention_bytes, token_embedding_spec
from megalite.model.llama import hf as hf_llama
from megalite.model.llama.titan import LLAMA_DCP
from megalite.parallel.param_spec import ParamSpec


def kv_split(kv_heads: int, tp: int) -> Tuple[int, int]:
    """(KV heads a TP rank holds, TP ranks that hold the same ones): n_kv / tp heads each when
    tp <= n_kv (tp divides n_kv), else one head shared by tp / n_kv ranks (n_kv divides tp;
    Megatron's replication of query groups)."""
    if tp <= kv_heads:
        return kv_heads // tp, 1
    return 1, tp // kv_heads


class LlamaFamily(Family):
    """Rotary positions, pre-RMSNorm blocks without biases, grouped-query attention, a SwiGLU
    MLP, an untied LM head (tied where `tie_word_embeddings` asks)."""

    name = "llama"
    qk_norm = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    probe_tensor = "model.layers.0.input_layernorm.weight"
    embedding_module = "model.embed_tokens"
    hf = hf_llama.LLAMA_MAPPING
    dcp = LLAMA_DCP

    def check(self, cfg: ModelConfig) -> None:
        """Grouped-query attention's KV heads, rotary positions' even head size and base."""
        if cfg.n_kv_head is not None and cfg.n_kv_head < 1:
            fail("model.n_kv_head", cfg.n_kv_head, "must be a positive integer or null "
                 "(= model.n_head)")
        if cfg.n_head % cfg.kv_heads:
            divisors = [d for d in range(1, cfg.n_head + 1) if cfg.n_head % d == 0]
            fail("model.n_kv_head", cfg.n_kv_head, f"must divide model.n_head={cfg.n_head} "
                 f"(each KV head serves n_head / n_kv_head query heads): use one of {divisors}")
        if cfg.head_size % 2:
            fail("model.n_head" if cfg.head_dim is None else "model.head_dim",
                 cfg.n_head if cfg.head_dim is None else cfg.head_dim,
                 f"head_dim = {cfg.head_size} must be even (RoPE rotates pairs)")
        if not cfg.rope_theta > 0:
            fail("model.rope_theta", cfg.rope_theta, "must be > 0 (Llama 3 uses 500000)")
        if cfg.rope_scaling is not None:
            cfg.rope_scaling.check()

    def check_tp(self, cfg: ModelConfig, tp: int) -> None:
        """TP splits the KV heads as it splits the query heads: n_kv_head / tp each when tp
        <= n_kv_head; when tp > n_kv_head each KV head is replicated over the tp / n_kv_head
        ranks whose query heads read it (Megatron's query groups), so n_kv_head must divide
        tp."""
        kv_heads = cfg.kv_heads
        if tp <= kv_heads and kv_heads % tp:
            fail("tp", tp, f"must divide model.n_kv_head={kv_heads} (TP splits the KV heads), "
                 f"or be a multiple of it (each KV head replicated over tp / n_kv_head ranks)")
        if tp > kv_heads and tp % kv_heads:
            fail("tp", tp, f"is larger than model.n_kv_head={kv_heads} but not a multiple of "
                 f"it; use a tp that divides {kv_heads} or a multiple of {kv_heads} (each KV "
                 "head is then replicated over tp / n_kv_head TP ranks)")

    def fp8_linears(self, cfg: ModelConfig, tp: int) -> List[Fp8Linear]:
        """o_proj, gate_up_proj, down_proj; the q/k/v projections stay in the model dtype
        (`megalite.model.llama.stage.Projection`)."""
        h, f, a = cfg.n_embd, cfg.ffn_size, cfg.n_head * cfg.head_size
        return [("model.layers.*.self_attn.o_proj", "model.n_head * head_dim / tp", a // tp,
                 "model.n_embd", h),
                ("model.layers.*.mlp.gate_up_proj", "model.n_embd", h,
                 "2 * model.n_inner / tp", 2 * f // tp),
                ("model.layers.*.mlp.down_proj", "model.n_inner / tp", f // tp, "model.n_embd", h)]

    def block_specs(self, cfg: ModelConfig, index: int, tp: int) -> Specs:
        h, f, d = cfg.n_embd, cfg.ffn_size, cfg.head_size
        replicas = kv_split(cfg.kv_heads, tp)[1]
        p = f"model.layers.{index}."

        def spec(name: str, shape, **split) -> Tuple[str, ParamSpec]:
            return p + name, ParamSpec(p + name, tuple(shape), **split)

        norms = [spec("self_attn.q_norm.weight", (d,)), spec("self_attn.k_norm.weight", (d,))] \
            if self.qk_norm else []
        return [
            spec("input_layernorm.weight", (h,)),
            spec("self_attn.q_proj.weight", (cfg.n_head * d, h), tp_dim=0),
            spec("self_attn.k_proj.weight", (cfg.kv_heads * d, h), tp_dim=0,
                 tp_replicas=replicas),
            spec("self_attn.v_proj.weight", (cfg.kv_heads * d, h), tp_dim=0,
                 tp_replicas=replicas),
            spec("self_attn.o_proj.weight", (h, cfg.n_head * d), tp_dim=1),
            *norms,
            spec("post_attention_layernorm.weight", (h,)),
            spec("mlp.gate_up_proj.weight", (2 * f, h), tp_dim=0, tp_interleave=2),
            spec("mlp.down_proj.weight", (h, f), tp_dim=1),
        ]

    def first_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        name = "model.embed_tokens.weight"
        return [(name, token_embedding_spec(name, cfg.vocab_size, cfg.n_embd, tp,
                                            cfg.tie_word_embeddings))]

    def final_norm_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        return [("model.norm.weight", ParamSpec("model.norm.weight", (cfg.n_embd,)))]

    def initial_value(self, cfg: ModelConfig, name: str) -> Initial:
        """transformers' `_init_weights` for Llama: linear layers and the embedding N(0,
        initializer_range), RMSNorm weights 1."""
        if name.endswith("norm.weight"):
            return Initial(1.0)
        return Initial(std=cfg.initializer_range)

    # --- FLOPs and activations ----------------------------------------------------------

    def block_parameters(self, cfg: ModelConfig) -> int:
        h, f, d = cfg.n_embd, cfg.ffn_size, cfg.head_size
        a, kv = cfg.n_head * d, cfg.kv_heads * d
        return 2 * h + 2 * a * h + 2 * kv * h + 3 * f * h + (2 * d if self.qk_norm else 0)

    def num_parameters(self, cfg: ModelConfig) -> int:
        """Parameters of the whole model (a tied embedding once, no padding)."""
        vh = cfg.vocab_size * cfg.n_embd
        return cfg.n_layer * self.block_parameters(cfg) + cfg.n_embd + vh \
            + (0 if cfg.tie_word_embeddings else vh)

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        """Training FLOPs per token: 6N + 12·L·h·s, N = every parameter but the token
        embedding's lookup (the LM head's matmul counted once, tied or not); 12·L·h·s = the
        attention scores and values over all n_head query heads (grouped-query attention
        shares K and V, not these products)."""
        n = cfg.n_layer * self.block_parameters(cfg) + cfg.n_embd + cfg.vocab_size * cfg.n_embd
        return 6 * n + self.attention_flops_per_pair(cfg) * seq_len

    def attention_flops_per_pair(self, cfg: ModelConfig) -> int:
        """12·L·(n_head · head_dim): n_embd unless head_dim sets the heads' size apart."""
        return 12 * cfg.n_layer * cfg.n_head * cfg.head_size

    def flops_formula(self) -> str:
        return "6N + 12*L*h*s (N = parameters except the token embedding's lookup)"

    def head_forward_flops_per_token(self, cfg: ModelConfig) -> int:
        return 2 * (cfg.vocab_size * cfg.n_embd + cfg.n_embd)  # LM head, the final RMSNorm

    def layer_activation_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, sp: bool,
                               e: int, dropout: bool = False,
                               math_attention: bool = False) -> float:
        """Bytes one Llama block keeps for backward per micro-batch on one rank: the two
        RMSNorms' inputs and outputs, e·s'b·4h (s' = s/t with SP); q after RoPE and the
        attention output, 2·e·sb·a/t (a = n_head × head dim); k after RoPE and v, 2·e·sb·g
        (g = this rank's KV heads × head dim); with q/k norms (Qwen3) their inputs,
        e·sb·(a/t + g), and fp32 reciprocal RMS a head and position; the MLP's [gate | up],
        silu(gate) and the product, 4·e·sb·f/t; RoPE's cos and sin (2·e·s·d); the norms' fp32
        reciprocal RMS (8·s'b); the attention's extra (`attention_bytes`); residual dropout
        masks (2·s'bh)."""
        h, d = cfg.n_embd, cfg.head_size
        a, kv_local = cfg.n_head * d, kv_split(cfg.kv_heads, t)[0]
        s_local = s // t if sp else s
        g = kv_local * d
        main = e * s_local * b * 4 * h + e * s * b * (2 * a / t + 2 * g + 4 * cfg.ffn_size / t)
        if self.qk_norm:
            main += e * s * b * (a / t + g) + 4 * s * b * (cfg.n_head // t + kv_local)
        attention = attention_bytes(s, b, a, cfg.n_head // t, t, e, math_attention)
        return main + 2 * e * s * d + 8 * s_local * b + attention \
            + (2 * s_local * b * h if dropout else 0)

    def block_backward_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, e: int) -> float:
        """The SwiGLU's gradients beyond the block's saved set: of [gate | up], 2·e·s·b·f/t."""
        return 2 * e * s * b * cfg.ffn_size / t


LLAMA_FAMILY = LlamaFamily()
