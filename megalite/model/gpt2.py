"""GPT-2, architecturally identical to `transformers.GPT2LMHeadModel` (Radford et al. 2019),
built from tensor-parallel layers; one instance is one pipeline stage.

Learned absolute positions, pre-LayerNorm blocks, tanh-approximated GELU, causal attention via
`scaled_dot_product_attention`, final LayerNorm, LM head tied to the token embedding. Dropout
sits where HF puts it: after the embedding sum (embd_pdrop), on the attention probabilities
(attn_pdrop), after each residual branch (resid_pdrop).

Parallel layout (Megatron): attention is split by heads (fused QKV column-parallel, output
projection row-parallel), the MLP's fc column-parallel and proj row-parallel, the token
embedding and LM head split over the (padded) vocabulary with a vocab-parallel cross-entropy.
Activations are [s, b, h]; with sequence parallelism the residual stream, LayerNorms and dropout
work on [s/tp, b, h]. A stage holds blocks `blocks` (global indices, so parameter names are the
HF names: `transformer.h.7.attn.c_attn.weight`), plus the embeddings if it is the first stage
and ln_f + LM head if it is the last. A last stage that is not also the first holds its own copy
of the token embedding as `lm_head.weight` (initialised identically; its gradient is summed with
the first stage's over the embedding group).

Each parameter has a `ParamSpec` in `model.param_specs` (global name, global shape, TP split);
weights use nn.Linear's [out, in] (HF's Conv1D stores [in, out]; `megalite.model.hf` transposes).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.config.schema import ModelConfig
from megalite.model.activation_offload import ActivationOffload, BlockChain, offloaded_blocks
from megalite.model.attention import kernel_region
from megalite.parallel.cross_entropy import cross_entropy
from megalite.parallel.group import Group, single_rank_group
from megalite.parallel.param_spec import ParamSpec, padded_vocab_size
from megalite.parallel.rng import RNGTracker
from megalite.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    gather_vocab,
    sequence_chunk,
)

RegionFactory = Callable[[], contextlib.AbstractContextManager]


def dropout(x: torch.Tensor, p: float, training: bool, region: RegionFactory) -> torch.Tensor:
    """F.dropout drawing from the RNG stream of `region`; nothing at all when p = 0."""
    if p == 0.0 or not training:
        return x
    with region():
        return F.dropout(x, p, True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto"):
        super().__init__()
        if cfg.n_head % tp_group.size:
            raise ValueError(f"n_head={cfg.n_head} not divisible by tp={tp_group.size}")
        self.heads = cfg.n_head // tp_group.size  # heads of this TP rank
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, tp_group, sp)  # [q|k|v]
        self.c_proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, tp_group, sp)
        self.attn_pdrop, self.resid_pdrop = cfg.attn_pdrop, cfg.resid_pdrop
        self.tp_region, self.residual_region = tp_region, residual_region
        self.kernel_region = kernel_region(attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # [s, b, 3 * heads * head_dim], this rank's [q_r | k_r | v_r]
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, 3, self.heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        p = self.attn_pdrop if self.training else 0.0
        with self.tp_region() if p > 0 else contextlib.nullcontext(), self.kernel_region():
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = self.c_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool,
                 residual_region: RegionFactory):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.n_embd, cfg.ffn_size, tp_group, sp)
        self.c_proj = RowParallelLinear(cfg.ffn_size, cfg.n_embd, tp_group, sp)
        self.resid_pdrop, self.residual_region = cfg.resid_pdrop, residual_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return dropout(y, self.resid_pdrop, self.training, self.residual_region)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                 residual_region: RegionFactory, attention: str = "auto"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, tp_group, sp, tp_region, residual_region, attention)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, tp_group, sp, residual_region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """The output layer, column-parallel over the vocabulary: [s(/tp), b, h] -> this rank's
    logits [s, b, V/tp]. Holds the output embedding: the first stage's `wte.weight` itself when
    the stage has both, else a copy (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, tp_group: Group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight_grad_queue = None  # zero-bubble schedules: W deferred (parallel.tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, None, self.tp_group,
                                      self.sequence_parallel, self.weight_grad_queue)


class GPT2(nn.Module):
    """One pipeline stage of GPT-2 (the whole model with the defaults: tp = pp = 1).

    forward(inputs, labels=None):
      inputs: token ids [b, s] on the first stage, else the previous stage's hidden states.
      Not the last stage: returns hidden states [s, b, h] ([s/tp, b, h] with SP).
      Last stage: the mean token cross-entropy with `labels` [b, s]; with labels and
      `per_sequence=True` each sequence's summed cross-entropy [b] over its labels >= 0
      (`sequence_losses`: scoring, e.g. HellaSwag); without labels, the logits
      [b, s, vocab_size] (gathered over TP, padding removed).

    `attention` names the SDPA kernel (`megalite.model.attention`; "auto" = PyTorch's choice).
    `recompute` re-runs blocks in backward instead of keeping their activations: every block of
    the stage, or its first `recompute_layers` (Megatron's "block" method: a stage that nearly
    fits recomputes only as many blocks as it must). `offload` (`megalite.model.activation_offload`,
    shared by a stage's chunks) moves what the blocks after the recomputed ones save to host
    memory until their backward: all of them, or the first `offload.layers`.
    """

    def __init__(self, cfg: ModelConfig, tp_group: Optional[Group] = None,
                 sequence_parallel: bool = False, rng: Optional[RNGTracker] = None,
                 blocks: Optional[range] = None, first: bool = True, last: bool = True,
                 recompute: bool = False, compile: bool = False, attention: str = "auto",
                 recompute_layers: Optional[int] = None,
                 offload: Optional[ActivationOffload] = None):
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group if tp_group is not None else single_rank_group("tp")
        self.sequence_parallel = sequence_parallel and self.tp_group.size > 1
        self.rng, self.recompute, self.recompute_layers = rng, recompute, recompute_layers
        self.offload = offload
        self.first, self.last = first, last
        self.blocks = blocks if blocks is not None else range(cfg.n_layer)
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, self.tp_group.size)
        sp, tp_group = self.sequence_parallel, self.tp_group
        tp_region = rng.tp_region if rng is not None else contextlib.nullcontext
        # Dropout on the residual stream: its own masks per TP rank only when SP shards it.
        residual_region = tp_region if sp else contextlib.nullcontext
        self.residual_region = residual_region

        self.transformer = nn.Module()
        if first:
            self.transformer.wte = VocabParallelEmbedding(self.padded_vocab, cfg.n_embd, tp_group, sp)
            self.transformer.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.transformer.h = nn.ModuleDict(
            {str(i): Block(cfg, tp_group, sp, tp_region, residual_region, attention)
             for i in self.blocks})
        if last:
            self.transformer.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
            self.lm_head = LMHead(self.transformer.wte.weight if first else nn.Parameter(
                torch.empty(self.padded_vocab // tp_group.size, cfg.n_embd)), tp_group, sp)
        self.param_specs: Dict[str, ParamSpec] = {
            name: self._spec(name, module) for name, module in self._param_owners().items()}
        if compile:
            # Each block's forward is compiled (fusing LayerNorm, GELU, residual adds, the
            # attention reshapes); module hooks (ZeRO-3 gathering) stay in eager Python. The
            # loss is not: chunked (`megalite.parallel.cross_entropy`), it holds in eager what
            # the compiled fp32 loss held (the logits and their gradient, plus one chunk)
            for block in self.transformer.h.values():
                block.forward = torch.compile(block.forward)

    # --- parameter metadata -------------------------------------------------------------

    def _param_owners(self) -> Dict[str, nn.Module]:
        owners = {}
        for mod_name, module in self.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                owners[full] = module
        names = {n for n, _ in self.named_parameters()}  # tied parameter listed once
        return {n: m for n, m in owners.items() if n in names}

    def _spec(self, name: str, module: nn.Module) -> ParamSpec:
        cfg, leaf = self.cfg, name.rsplit(".", 1)[-1]
        if name in ("transformer.wte.weight", "lm_head.weight"):
            return ParamSpec("transformer.wte.weight", (cfg.vocab_size, cfg.n_embd), tp_dim=0,
                             padded_rows=self.padded_vocab, tied=True,
                             tied_copy=name == "lm_head.weight")
        param = getattr(module, leaf)
        tp = self.tp_group.size
        if isinstance(module, ColumnParallelLinear):
            interleave = 3 if name.endswith("c_attn." + leaf) else 1
            shape = (param.shape[0] * tp, *param.shape[1:])
            return ParamSpec(name, shape, tp_dim=0, tp_interleave=interleave)
        if isinstance(module, RowParallelLinear) and leaf == "weight":
            return ParamSpec(name, (param.shape[0], param.shape[1] * tp), tp_dim=1)
        return ParamSpec(name, tuple(param.shape))  # replicated over TP

    @property
    def chunks(self) -> List["GPT2"]:
        """The model chunks this module is made of: itself (`megalite.model.stage` holds
        several for the interleaved schedule)."""
        return [self]

    def sharding_units(self) -> List[nn.Module]:
        """The modules ZeRO-3 gathers one at a time, in forward order."""
        t = self.transformer
        units = [t.wte, t.wpe] if self.first else []
        units += list(t.h.values())
        if self.last:
            units += [t.ln_f, self.lm_head]
        return units

    # --- forward ------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or this rank's [s/tp, b, h] with SP)."""
        s = ids.shape[1]
        if s > self.cfg.n_positions:
            raise ValueError(f"sequence length {s} > model.n_positions={self.cfg.n_positions}")
        t = self.transformer
        x = t.wte(ids.t())
        chunk = sequence_chunk(s, self.tp_group, self.sequence_parallel)
        pos = torch.arange(chunk.start, chunk.stop, device=ids.device)
        x = x + t.wpe(pos).unsqueeze(1)
        return dropout(x, self.cfg.embd_pdrop, self.training, self.residual_region)

    def recomputed_blocks(self) -> int:
        """How many of the chunk's first blocks re-run their forward in backward."""
        if not self.recompute:
            return 0
        n = len(self.blocks)
        return n if self.recompute_layers is None else min(self.recompute_layers, n)

    def _run_block(self, index: int, block: Block, x: torch.Tensor,
                   chain: Optional[BlockChain]) -> torch.Tensor:
        """Block `index` of this stage; recomputed in backward when recompute is on and the
        block is among the stage's first `recompute_layers` (all of them when None); with
        `chain` (activation offload, training) its saved tensors go to host memory when it is
        among the offloaded blocks (`offloaded_blocks`)."""
        recomputed = self.recomputed_blocks()
        if index < recomputed and self.training and torch.is_grad_enabled():
            return recompute_block(block, x, self.rng)
        if chain is not None:  # offloaded or not: the chain keeps the blocks in transit
            return chain.run(index, block, x)
        return block(x)

    def logits_local(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: ln_f and the LM head -> this rank's vocabulary slice [s, b, V/tp]."""
        return self.lm_head(self.transformer.ln_f(x))

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [N] (fp32) of this rank's logits [N, V/tp] and the targets
        [N]: the chunked, vocab-parallel loss (`megalite.parallel.cross_entropy`; with tp = 1
        a group of one). Padded vocabulary columns never count; no fp32 copy of the whole
        logits is made."""
        return cross_entropy(logits, targets, self.tp_group,
                             self.tp_group.rank * logits.shape[-1], self.cfg.vocab_size)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all tokens; logits [s, b, V/tp], labels [b, s]."""
        return self.token_losses(logits.reshape(-1, logits.shape[-1]),
                                 labels.t().reshape(-1)).mean()

    def sequence_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of each sequence [b] (fp64) over the positions whose label
        is >= 0; a negative label (-100) marks a position that does not count (padding, or a
        token that is only context). logits [s, b, V/tp], labels [b, s]. Per token the same
        cross-entropy as `loss`."""
        s, b = logits.shape[:2]
        targets = labels.t().reshape(-1)
        counted = targets >= 0
        per_token = self.token_losses(logits.reshape(-1, logits.shape[-1]),
                                      targets.clamp(min=0))
        per_token = torch.where(counted, per_token, torch.zeros_like(per_token))
        return per_token.view(s, b).double().sum(dim=0)

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                per_sequence: bool = False) -> torch.Tensor:
        x = self.embed(inputs) if self.first else inputs
        offloading = self.offload is not None and self.training and torch.is_grad_enabled()
        chain = self.offload.chain(offloaded_blocks(
            len(self.blocks), self.recomputed_blocks(), self.offload.layers),
            len(self.blocks)) if offloading else None
        for index, block in enumerate(self.transformer.h.values()):
            x = self._run_block(index, block, x, chain)
        if not self.last:
            return x
        logits = self.logits_local(x)
        if labels is not None and per_sequence:
            return self.sequence_losses(logits, labels)
        if labels is not None:
            return self.loss(logits, labels)
        return gather_vocab(logits, self.tp_group, self.cfg.vocab_size).transpose(0, 1)


def recompute_block(block: nn.Module, x: torch.Tensor, rng: Optional[RNGTracker]
                    ) -> torch.Tensor:
    """Activation recomputation (Chen et al. 2016; Korthikanti 2022 "full" recompute): keep only
    the block's input and re-run its forward during backward. torch's checkpoint restores the
    default (replicated) RNG stream for the re-run; the TP stream is restored here, so the
    re-run draws the same dropout masks, and put back afterwards so later forwards continue
    their own stream."""
    if rng is None:
        return checkpoint(block, x, use_reentrant=False)
    snapshot = rng.tp_state()
    calls = [0]

    def run(inp: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            return block(inp)
        current = rng.tp_state()
        rng.set_tp_state(snapshot)
        try:
            return block(inp)
        finally:
            rng.set_tp_state(current)

    return checkpoint(run, x, use_reentrant=False)


def num_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (tied embedding once, no padding)."""
    h, f = cfg.n_embd, cfg.ffn_size
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    return cfg.n_layer * block + 2 * h + cfg.vocab_size * h + cfg.n_positions * h


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12·L·h·s (Kaplan et al. 2020; Chowdhery et al. 2022, App. B).

    N = parameters that take part in matmuls or elementwise ops per token: every parameter except
    the position embedding (a lookup), the token embedding counted once as the LM-head matmul.
    6N = forward (2N) + backward (4N); 12·L·h·s = the attention score and value matmuls
    (QK^T and AV, forward + backward) not covered by N.
    """
    n = num_parameters(cfg) - cfg.n_positions * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len
