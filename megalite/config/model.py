"""The `model` section: a model's family (`model.arch`) and shape, with `transformers`' GPT2Config
field names (a Llama's LlamaConfig names in the comments), and the rules a shape keeps by itself
(the rules a family adds are its own, asked through `megalite.config.families`; those that
involve the layout are `megalite.config.layout`'s).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from megalite.config.errors import fail
from megalite.config.families import registered_family
from megalite.config.moe import MoEConfig


@dataclass
class RopeScaling:
    """Llama 3's frequency scaling of rotary positions (LlamaConfig.rope_scaling with
    rope_type "llama3"; `megalite.model.llama.rope`). Llama 3.1/3.2's values are the defaults."""

    rope_type: str = "llama3"
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def check(self) -> None:
        if self.rope_type != "llama3":
            fail("model.rope_scaling.rope_type", self.rope_type,
                 "megalite's Llama scales RoPE as Llama 3 does: use llama3 (or rope_scaling=null)")
        for key in ("factor", "low_freq_factor", "original_max_position_embeddings"):
            if not getattr(self, key) > 0:
                fail(f"model.rope_scaling.{key}", getattr(self, key), "must be > 0")
        if not self.high_freq_factor > self.low_freq_factor:
            fail("model.rope_scaling.high_freq_factor", self.high_freq_factor,
                 f"must be > model.rope_scaling.low_freq_factor={self.low_freq_factor}")


@dataclass
class ModelConfig:
    """The model's family and shape (docs/models.md)."""

    name: str = "tiny"  # preset name, for the record (the shape below is what counts)
    arch: str = "gpt2"  # model family: gpt2 | llama | mixtral | qwen3 | qwen3_moe
    n_layer: int = 4  # num_hidden_layers
    n_embd: int = 128  # hidden_size
    n_head: int = 4  # num_attention_heads
    n_kv_head: Optional[int] = None  # num_key_value_heads (llama); None = n_head
    head_dim: Optional[int] = None  # qwen3: each head's size; None = n_embd / n_head
    n_positions: int = 256  # max_position_embeddings
    vocab_size: int = 50257
    n_inner: Optional[int] = None  # MLP hidden size (intermediate_size); None = 4 * n_embd
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1  # attention_dropout
    layer_norm_epsilon: float = 1e-5  # rms_norm_eps
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True  # the LM head is the token embedding (GPT-2: always)
    rope_theta: float = 10000.0  # llama: the rotary base
    rope_scaling: Optional[RopeScaling] = None  # llama: Llama 3's RoPE scaling, or none
    moe: MoEConfig = field(default_factory=MoEConfig)  # Mixture-of-Experts (mixtral; docs/moe.md)

    @property
    def ffn_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_size(self) -> int:
        """Each attention head's size (head_dim where set, else n_embd / n_head)."""
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention; n_head where not set)."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @classmethod
    def from_record(cls, record: dict) -> "ModelConfig":
        """The config a checkpoint's meta.json recorded (`dataclasses.asdict`; a key an
        older megalite did not write takes its default)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        if isinstance(values.get("moe"), dict):
            values["moe"] = MoEConfig(**values["moe"])
        return cls(**values)

    def check(self) -> None:
        family = registered_family(self.arch)
        for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            if getattr(self, key) < 1:
                fail(f"model.{key}", getattr(self, key), "must be a positive integer")
        for key in ("layer_norm_epsilon", "initializer_range"):
            if not getattr(self, key) > 0:
                fail(f"model.{key}", getattr(self, key), "must be > 0 (GPT-2 uses "
                     f"{getattr(ModelConfig, key)})")
        if self.n_inner is not None and self.n_inner < 1:
            fail("model.n_inner", self.n_inner, "must be a positive integer or null (= 4 * n_embd)")
        if self.head_dim is not None and not getattr(family, "own_head_dim", False):
            fail("model.head_dim", self.head_dim, f"model.arch={self.arch} has head_dim = "
                 "n_embd / n_head: use null (model.arch=qwen3 or qwen3_moe take a head_dim)")
        if self.head_dim is not None and self.head_dim < 1:
            fail("model.head_dim", self.head_dim, "must be a positive integer or null "
                 "(= n_embd / n_head)")
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            fail("model.n_head", self.n_head, f"must divide model.n_embd={self.n_embd} (or "
                 "model.head_dim set the heads' size, where the family takes it)")
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if not 0.0 <= getattr(self, key) < 1.0:
                fail(f"model.{key}", getattr(self, key), "dropout probability must be in [0, 1)")
        self.moe.check()
        if self.moe.enabled != bool(getattr(family, "mixture_of_experts", False)):
            fail("model.moe.num_experts", self.moe.num_experts,
                 f"model.arch={self.arch} has MoE layers: set model.moe.num_experts >= 1 (e.g. "
                 "model=mixtral-tiny)" if self.moe.num_experts == 0 else
                 f"model.arch={self.arch} is dense: use 0, or an MoE family (model.arch=mixtral)")
        family.check(self)
