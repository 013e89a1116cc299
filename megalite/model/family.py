"""The model family interface: what a family (GPT-2, Llama) supplies to the machinery the
families share — the tensor-parallel layers, the pipeline stage (`megalite.model.causal_lm`),
the engine, the checkpoints and the plan — so that none of those asks which family it runs.

A family lives in its own folder (`megalite.model.gpt2`, `megalite.model.llama`): its
stage (a `CausalLM` whose `family` is its `Family`: embeddings, blocks, final norm, head; the
forward, loss and recompute are shared) and its `Family`, registered once through its stage
(`megalite.model.families.register`). A family supplies:

    check, check_tp, fp8_linears
                          its config rules and FP8 linears (what `megalite.config` asks,
                          `megalite.config.families`)
    block_specs / first_specs / final_norm_specs
                          its parameters' `ParamSpec`s, in the order the stage registers them
                          (`stage_specs` lists a stage's, the LM head's from the embedding's)
                          (names = transformers' names; global shape; how TP splits each):
                          the stage's `param_specs` and the plan's parameter lists (ZeRO's
                          buckets, Ψ, ZeRO-3's units) are both made from them
    initial_value         how a parameter starts (GPT-2: N(0, 0.02), residual projections
                          scaled, LayerNorms (1, 0); Llama: N(0, 0.02), RMSNorms 1)
    num_parameters, active_parameters, flops_per_token, block_parameters,
    head_forward_flops_per_token
                          the parameters and FLOPs the metrics, the header and the time
                          model count (MoE: FLOPs of the active parameters)
    mixture_of_experts, routing_ledger
                          MoE layers (`megalite.model.moe`) and the stage's record of them
    layer_activation_bytes, block_backward_bytes
                          the memory plan's activation terms of one block
    hf                    the mapping to and from `transformers` (`HFMapping`)
    dcp                   its names in torch.distributed.checkpoint (DCP) checkpoints of the
                          framework that holds it, e.g. torchtitan's Llama 3 (`DCPMapping`),
                          or None: what `--format dcp` and `init_from` a DCP checkpoint use
    probe_tensor          the fault drill's default tensor (the first block's first norm)

`megalite.model.families.family(cfg)` gives the family of a `ModelConfig` (`model.arch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megalite.config.families import Fp8Linear
from megalite.config.schema import ModelConfig
from megalite.model.moe.ledger import RoutingLedger
from megalite.parallel.param_spec import ParamSpec, padded_vocab_size

Specs = List[Tuple[str, ParamSpec]]  # (the name in the stage's module tree, its spec)


@dataclass(frozen=True)
class HFMapping:
    """A family's mapping between megalite's global state and a `transformers` model: its
    names, and the functions of its `hf` module."""

    model_type: str  # config.json's model_type
    model_class: str  # the transformers class (GPT2LMHeadModel, LlamaForCausalLM)
    display: str  # the family's name in messages (GPT-2, Llama)
    hub_example: str  # a hub id of the family, for messages
    # (cfg, bos_token_id=None, eos_token_id=None) -> the transformers config of a model shape
    hf_config: Callable
    to_hf_state_dict: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]
    from_hf_state_dict: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]
    check_config: Callable[[ModelConfig, object, str], None]  # (cfg, hf_cfg, source)
    derived: Callable[[str], bool]  # a transformers key megalite's state does not hold
    # (cfg) -> None, or a ConfigError where the model class cannot compute the model
    check_export: Optional[Callable[[ModelConfig], None]] = None
    # (hf_cfg, source) -> `ModelKeys`: the model config a config.json describes (`init_from`)
    model_keys: Optional[Callable[[object, str], "ModelKeys"]] = None


@dataclass(frozen=True)
class ModelKeys:
    """The `model.*` keys a transformers config.json gives (dotted below `model.`, e.g.
    `moe.num_experts`): `shape`, what the weights compute (the architecture and every shape:
    a key the user gives must agree), and `defaults`, what the model was trained with that a
    run may change (dropout, initialisation, the aux loss's coefficient): taken where the
    user gives none."""

    shape: Dict[str, object]
    defaults: Dict[str, object]


@dataclass(frozen=True)
class DCPMapping:
    """A family's mapping between megalite's global state and a DCP checkpoint's flat model
    keys (`megalite.checkpoint.dcp_export` writes and reads the files)."""

    display: str  # the model the checkpoint holds, for messages (torchtitan's Llama 3)
    # (megalite name, tensor, cfg) -> the (key, tensor) pairs that tensor becomes
    to_dcp: Callable[[str, torch.Tensor, ModelConfig], Iterator[Tuple[str, torch.Tensor]]]
    # (the model keys' tensors, cfg) -> megalite's global state
    from_dcp: Callable[[Dict[str, torch.Tensor], ModelConfig], Dict[str, torch.Tensor]]
    is_model_key: Callable[[str], bool]  # a weight (not optimizer, dataloader, ... state)


@dataclass(frozen=True)
class Initial:
    """A parameter's starting value: `fill` everywhere, or N(0, std) when std is set."""

    fill: float = 0.0
    std: Optional[float] = None


class Family:
    """One model family (module docstring). Subclasses set the class attributes and
    implement the spec lists, initialisation and FLOP / activation terms."""

    name: str = ""
    mixture_of_experts: bool = False  # MoE layers (model.moe; `megalite.model.moe`)
    # replicated weights a TP rank uses on its own heads only (Qwen3's q/k norms): their
    # gradients are partial over TP, summed with SP's norms' (so tp > 1 needs sp)
    tp_partial_weights: bool = False
    own_head_dim: bool = False  # model.head_dim sets the heads' size apart from n_embd (Qwen3)
    probe_tensor: str = ""
    embedding_module: str = ""  # the token embedding's module path in a stage
    hf: HFMapping
    dcp: Optional[DCPMapping] = None

    # --- config rules (`megalite.config.families.FamilyRules`) ------------------------------

    def check(self, cfg: ModelConfig) -> None:
        """The family's rules of a model shape beyond the shared ones (none by default)."""

    def check_tp(self, cfg: ModelConfig, tp: int) -> None:
        """The family's rules between its shape and tp beyond heads, hidden and MLP size."""

    # --- parameters ---------------------------------------------------------------------

    def block_specs(self, cfg: ModelConfig, index: int, tp: int) -> Specs:
        raise NotImplementedError

    def first_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        """The first stage's parameters (the embeddings)."""
        raise NotImplementedError

    def final_norm_specs(self, cfg: ModelConfig, tp: int) -> Specs:
        """The final norm's parameters (the last stage's, before the head)."""
        raise NotImplementedError

    def stage_specs(self, cfg: ModelConfig, blocks: range, tp: int, first: bool,
                    last: bool) -> Specs:
        """A stage's parameters in registration order: the embeddings when `first`, the
        blocks `blocks`, the final norm and the LM head when `last` (under a tied embedding
        the head is a `tied_copy`, registered only where the stage lacks the embedding)."""
        embeddings = self.first_specs(cfg, tp)
        specs = list(embeddings) if first else []
        for i in blocks:
            specs += self.block_specs(cfg, i, tp)
        if last:
            specs += self.final_norm_specs(cfg, tp) + [head_spec(embeddings[0][1])]
        return specs

    def initial_value(self, cfg: ModelConfig, name: str) -> Initial:
        raise NotImplementedError

    def routing_ledger(self, cfg: ModelConfig, blocks: range) -> Optional[RoutingLedger]:
        """The ledger a stage of `blocks` keeps of its MoE layers' routing (None: no MoE
        layer among them, or a dense family)."""
        layers = [i for i in blocks if self.mixture_of_experts and cfg.moe.is_moe_layer(i)]
        return RoutingLedger(cfg.moe, layers) if layers else None

    def block_numel(self, cfg: ModelConfig, tp: int) -> int:
        """Parameter elements of one block on one TP rank."""
        return sum(local_numel(s, tp) for _, s in self.block_specs(cfg, 0, tp))

    # --- FLOPs and activations ----------------------------------------------------------

    def num_parameters(self, cfg: ModelConfig) -> int:
        raise NotImplementedError

    def active_parameters(self, cfg: ModelConfig) -> int:
        """The parameters a token passes through (MoE: the top-k routed and the shared
        experts only); all of them in a dense model."""
        return self.num_parameters(cfg)

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        raise NotImplementedError

    def flops_formula(self) -> str:
        raise NotImplementedError

    def attention_flops_per_pair(self, cfg: ModelConfig) -> int:
        """Training FLOPs of one (query, key) pair over all layers and heads: QK^T and AV,
        forward and backward, 12·L·h (so `flops_per_token`'s 12·L·h·s counts every query
        against all s keys of its window: the dense count MFU keeps under any mask)."""
        return 12 * cfg.n_layer * cfg.n_embd

    def block_parameters(self, cfg: ModelConfig) -> int:
        """One block's parameters (tp = 1): the time model's 2·P_block FLOPs a token."""
        raise NotImplementedError

    def block_parameters_of(self, cfg: ModelConfig, index: int) -> int:
        """Block `index`'s `block_parameters` (every block alike by default)."""
        return self.block_parameters(cfg)

    def fp8_linears(self, cfg: ModelConfig, tp: int) -> List[Fp8Linear]:
        """The block's column- and row-parallel linears, the matmuls fp8.recipe runs in FP8
        (`megalite.parallel.fp8`), at `tp` (`megalite.config.families.Fp8Linear`)."""
        raise NotImplementedError

    def fp8_linear_parameters(self, cfg: ModelConfig) -> int:
        """One block's weights (tp = 1) in its FP8 linears."""
        return sum(k * n for _, _, k, _, n in self.fp8_linears(cfg, 1))

    def head_forward_flops_per_token(self, cfg: ModelConfig) -> int:
        """The last stage's forward FLOPs a token beyond its blocks (the LM head, the norm)."""
        raise NotImplementedError

    def layer_activation_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, sp: bool,
                               e: int, dropout: bool = False,
                               math_attention: bool = False) -> float:
        raise NotImplementedError

    def block_backward_bytes(self, cfg: ModelConfig, s: int, b: int, t: int, e: int) -> float:
        """What a block's backward holds beyond its saved set (the MLP's gradients)."""
        raise NotImplementedError

    def block_activation_bytes(self, cfg: ModelConfig, index: int, s: int, b: int, t: int,
                               sp: bool, e: int, dropout: bool = False,
                               math_attention: bool = False, ep: int = 1) -> float:
        """Block `index`'s `layer_activation_bytes` under `ep` (every block alike but in a
        family whose blocks differ: an MoE model's dense and MoE blocks)."""
        return self.layer_activation_bytes(cfg, s, b, t, sp, e, dropout, math_attention)

    def block_backward_bytes_of(self, cfg: ModelConfig, index: int, s: int, b: int, t: int,
                                e: int, sp: bool = False, ep: int = 1) -> float:
        """Block `index`'s `block_backward_bytes` under `ep` (every block alike by default)."""
        return self.block_backward_bytes(cfg, s, b, t, e)


def token_embedding_spec(name: str, vocab_size: int, n_embd: int, tp: int,
                         tied: bool) -> ParamSpec:
    """The token embedding's spec: vocab-parallel, the vocabulary padded to 128·tp; `tied`:
    the LM head is this embedding (`model.tie_word_embeddings`)."""
    return ParamSpec(name, (vocab_size, n_embd), tp_dim=0,
                     padded_rows=padded_vocab_size(vocab_size, tp), tied=tied)


def head_spec(embedding: ParamSpec) -> Tuple[str, ParamSpec]:
    """The LM head's (name, spec), from the token embedding's spec: its own vocab-parallel
    parameter (`lm_head.weight`), or under a tied embedding a `tied_copy` of the embedding."""
    if embedding.tied:
        return "lm_head.weight", ParamSpec(embedding.name, embedding.shape, tp_dim=0,
                                           padded_rows=embedding.padded_rows, tied=True,
                                           tied_copy=True)
    return "lm_head.weight", ParamSpec("lm_head.weight", embedding.shape, tp_dim=0,
                                       padded_rows=embedding.padded_rows)


def local_numel(spec: ParamSpec, tp: int) -> int:
    """Elements of one TP rank's slice of `spec` (its padded shape, split `tp` ways, or
    tp / tp_replicas ways where TP ranks share slices)."""
    shape = list(spec.padded_shape())
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= spec.tp_chunks(tp, 0)[0]
    return math.prod(shape)


def attention_bytes(s: int, b: int, h: int, heads: int, t: int, e: int,
                    math_attention: bool) -> float:
    """What SDPA keeps beyond its inputs and output per micro-batch on one rank: the flash and
    memory-efficient kernels the log-sum-exp (4 bytes a query head and position), the math
    kernel (attention dropout on a CPU, train.attention=math) the probabilities, their dropout
    mask and the dropped probabilities (3·e·b(a/t)s²) and the scaled q and k (2·e·sbh/t)."""
    if math_attention:
        return 3 * e * b * heads * s * s + 2 * e * s * b * h / t
    return 4 * heads * s * b
