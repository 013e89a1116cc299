"""GPT-2's side of the family interface (`megalite.model.family`): its parameters (names and
TP splits of `transformers.GPT2LMHeadModel`), initialisation, FLOPs and activation terms. The
modules are `megalite.model.gpt2.stage`, the `transformers` mapping `megalite.model.gpt2.hf`."""
from __future__ import annotations

import math
from typing import List

from megalite.config.errors import fail
from megalite.config.families import Fp8Linear
from megalite.config.schema import ModelConfig
from megalite.model.family import Family, Initial, Specs, attention_bytes, token_embedding_spec
from megalite.model.gpt2 import hf
from megalite.parallel.param_spec import ParamSpec


def _replicated(name: str, *shape: int):
    return name, ParamSpec(name, tuple(shape))


class GPT2Family(Family):
    """Learned positions, pre-LayerNorm blocks with biases, fused QKV, tanh-GELU MLP, the LM
    head tied to the token embedding."""

    name = "gpt2"
    probe_tensor = "transformer.h.0.ln_1.weight"
    embedding_module = "transformer.wte"
    hf = hf.GPT2_MAPPING

    def check(self, cfg: ModelConfig) -> None:
        """GPT-2 has one setting of what a Llama may vary."""
        if not cfg.tie_word_embeddings:
            fail("model.tie_word_embeddings", cfg.tie_word_embeddings,
                 "GPT-2's LM head is its token embedding: set true (or model.arch=llama)")
        if cfg.kv_heads != cfg.n_head:
            fail("model.n_kv_head", cfg.n_kv_head, "GPT-2 has no grouped-query attention: "
                 "set null (or model.arch=llama)")
        if cfg.rope_scaling is not None:
            fail("model.rope_scaling", cfg.rope_scaling, "GPT-2 has learned positions, no "
                 "rotary ones: set null (or model.arch=llama)")

    def fp8_linears(self, cfg: ModelConfig, tp: int) -> List[Fp8Linear]:
        h, f = cfg.n_embd, cfg.ffn_size
        return [("transformer.h.*.attn.c_attn", "model.n_embd", h, "3 * model.n_embd / tp",
                 3 * h // tp),
                ("transformer.h.*.attn.c_proj", "model.n_embd / tp", h // tp, "model.n_embd", h),
                ("transformer.h.*.mlp.c_fc", "model.n_embd", h, "model.n_inner / tp", f // tp),
                ("transformer.h.*.mlp.c_proj", "model.n_inner / tp", f // tp, "model.n_embd", h)]

    def block_specs(self, cfg: ModelConfig, index: int, tp: int) -> Specs:
        h, f = cfg.n_embd, cfg.ffn_size
        p = f"transformer.h.{index}."
        return [
            _replicated(p + "ln_1.weight", h), _replicated(p + "ln_1.bias", h),
            # HF's fused c_attn is [q | k | v]: each block split over TP (whole heads a rank)
            (p + "attn.c_attn.weight",
             ParamSpec(p + "attn.c_attn.weight", (3 * h, h), tp_dim=0, tp_interleave=3)),
            (p + "attn.c_attn.bias",
             ParamSpec(p + "attn.c_attn.bias", (3 * h,), tp_dim=0, tp_interleave=3)),
            (p + "attn.c_proj.weight", ParamSpec(p + "attn.c_proj.weight", (h, h), tp_dim=1)),
            _replicated(p + "attn.c_proj.bias", h),
            _replicated(p + "ln_2.weight", h), _replicated(p + "ln_2.bias", h),
            (p + "mlp.c_fc.weight", ParamSpec(p + "mlp.c_fc.weight", (f, h), tp_dim=0)),
            (p + "mlp.c_fc.bias", ParamSpec(p + "mlp.c_fc.bias", (f,), tp_dim=0)),
            (p + "mlp.c_proj.weight", ParamSpec(p + "mlp.c_proj.weight", (h, f), tp_dim=1)),
            _replicated(p + "mlp.c_proj.bias", h),
        ]

    def first_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        name = "transformer.wte.weight"
        return [(name, token_embedding_spec(name, cfg.vocab_size, cfg.n_embd, tp,
                                            cfg.tie_word_embeddings)),
                _replicated("transformer.wpe.weight", cfg.n_positions, cfg.n_embd)]

    def final_norm_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        return [_replicated("transformer.ln_f.weight", cfg.n_embd),
                _replicated("transformer.ln_f.bias", cfg.n_embd)]

    def initial_value(self, cfg: ModelConfig, name: str) -> Initial:
        """GPT-2 paper §2.3, HF `_init_weights`: weights N(0, 0.02), biases 0, LayerNorm
        (1, 0), and the residual output projections (`attn.c_proj`, `mlp.c_proj`)
        N(0, 0.02 / sqrt(2 n_layer)) so the residual stream's variance does not grow with
        depth."""
        leaf = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 2)[-2]
        if owner.startswith("ln_"):
            return Initial(1.0 if leaf == "weight" else 0.0)
        if leaf == "bias":
            return Initial(0.0)
        std = cfg.initializer_range
        if owner == "c_proj":
            std /= math.sqrt(2 * cfg.n_layer)
        return Initial(std=std)

    # --- FLOPs and activations ----------------------------------------------------------

    def block_parameters(self, cfg: ModelConfig) -> int:
        h, f = cfg.n_embd, cfg.ffn_size
        return 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    def num_parameters(self, cfg: ModelConfig) -> int:
        """Parameters of the whole model (tied embedding once, no padding)."""
        h = cfg.n_embd
        return cfg.n_layer * self.block_parameters(cfg) + 2 * h + cfg.vocab_size * h \
            + cfg.n_positions * h

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        """Training FLOPs per token: 6N + 12·L·h·s (Kaplan et al. 2020; Chowdhery et al.
        2022, App. B). N = parameters that take part in matmuls or elementwise ops per token:
        every parameter except the position embedding (a lookup), the token embedding counted
        once as the LM-head matmul. 6N = forward (2N) + backward (4N); 12·L·h·s = the
        attention score and value matmuls (QK^T and AV, forward + backward) not covered by N."""
        n = self.num_parameters(cfg) - cfg.n_positions * cfg.n_embd
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len

    def flops_formula(self) -> str:
        return "6N + 12*L*h*s (N = parameters except position embedding)"

    def head_forward_flops_per_token(self, cfg: ModelConfig) -> int:
        return 2 * (cfg.vocab_size * cfg.n_embd + 2 * cfg.n_embd)  # LM head, ln_f

    def layer_activation_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, sp: bool,
                               e: int, dropout: bool = False,
                               math_attention: bool = False) -> float:
        return layer_activation_bytes(s, b, cfg.n_embd, cfg.n_head, t, sp, e, dropout,
                                      math_attention)

    def block_backward_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, e: int) -> float:
        """GELU's gradient, e·s·b·f/t beyond the block's saved set."""
        return e * s * b * cfg.ffn_size / t


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, e: int,
                           dropout: bool = False, math_attention: bool = False) -> float:
    """Bytes one GPT-2 layer keeps for backward per micro-batch (`megalite.plan.memory`'s
    formula): e·sbh(4 + 12/t), or e·sbh·16/t with SP (Korthikanti et al. 2022, fused
    attention) — the two LayerNorms' inputs and outputs (4·sbh, /t with SP), q, k, v and the
    attention output (4·sbh/t), the MLP's input of GELU and its output (8·sbh/t) — + LayerNorm
    statistics (16·s'b), the attention's extra (`attention_bytes`) and, with dropout, the
    residual dropout masks (2·s'bh)."""
    s_local = s // t if sp else s
    main = e * s * b * h * (16 / t if sp else 4 + 12 / t)
    attention = attention_bytes(s, b, h, a // t, t, e, math_attention)
    return main + 16 * s_local * b + attention + (2 * s_local * b * h if dropout else 0)


GPT2_FAMILY = GPT2Family()
