"""One pipeline stage of a decoder-only language model, whatever its family: the part every
family shares (the block interface). A family's stage (`megalite.model.gpt2.GPT2`,
`megalite.model.llama.Llama`) builds its modules — the embeddings on the first stage, its
blocks, the final norm on the last — and says how the embeddings run; everything else is here:
the LM head (vocab-parallel, the token embedding itself or a copy of it when tied, else a
parameter of its own), the blocks run one after the other (recomputed or their activations
offloaded as configured), the loss, the parameter specs, compilation.

Activations are [s, b, h]; with sequence parallelism the residual stream, norms and dropout
work on [s/tp, b, h]. A stage holds blocks `blocks` (global indices, so parameter names are the
transformers names: `transformer.h.7.attn.c_attn.weight`, `model.layers.7.mlp.down_proj.weight`).
Each parameter has a `ParamSpec` in `param_specs`, taken from the family's spec lists
(`megalite.model.family`): the plan counts from the same lists without building a model.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.config.schema import ModelConfig
from megalite.data.documents import Documents
from megalite.model.activation_offload import ActivationOffload, BlockChain, offloaded_blocks
from megalite.model.document_attention import AttentionInputs
from megalite.model.family import Family
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.ledger import RoutingLedger, with_penalty, with_scaled_penalty
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.cross_entropy import cross_entropy
from megalite.parallel.group import Group, single_rank_group
from megalite.parallel.param_spec import ParamSpec, padded_vocab_size
from megalite.parallel.rng import RNGTracker
from megalite.parallel.tensor import column_parallel_linear, gather_vocab

RegionFactory = Callable[[], contextlib.AbstractContextManager]


def dropout(x: torch.Tensor, p: float, training: bool, region: RegionFactory) -> torch.Tensor:
    """F.dropout drawing from the RNG stream of `region`; nothing at all when p = 0."""
    if p == 0.0 or not training:
        return x
    with region():
        return F.dropout(x, p, True)


class LMHead(nn.Module):
    """The output layer, column-parallel over the vocabulary: [s(/tp), b, h] -> this rank's
    logits [s, b, V/tp]. Holds the output embedding: the first stage's token embedding itself
    when tied and the stage has both, a copy of it when tied and not, else its own."""

    def __init__(self, weight: nn.Parameter, tp_group: Group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight_grad_queue = None  # zero-bubble schedules: W deferred (parallel.tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, None, self.tp_group,
                                      self.sequence_parallel, self.weight_grad_queue)


class CausalLM(nn.Module):
    """One pipeline stage of a decoder-only LM (the whole model with the defaults: tp = pp = 1).

    forward(inputs, labels=None, per_sequence=False, documents=None):
      inputs: token ids [b, s] on the first stage, else the previous stage's hidden states.
      Not the last stage: returns hidden states [s, b, h] ([s/tp, b, h] with SP).
      Last stage: the mean token cross-entropy with `labels` [b, s]; with labels and
      `per_sequence=True` each sequence's summed cross-entropy [b] over its labels >= 0
      (`sequence_losses`: scoring, e.g. HellaSwag); without labels, the logits
      [b, s, vocab_size] (gathered over TP, padding removed). `documents`
      (`megalite.data.documents`): attention within documents, positions restarting at each,
      targets after EOS left out of the loss, as the run sets them; None: none of these.
      A stage with MoE layers (`routing`, a `megalite.model.moe.ledger.RoutingLedger`) adds
      their balancing penalty of a training forward to the loss's gradient, not to its value;
      a stage without the LM head to its output's gradient, weighted by `objective_scale`.

    `expert_dispatch` (ep > 1): the token exchange of the MoE layers, which then hold E/ep
    of the experts (`megalite.model.moe.dispatcher`).
    `attention` names the SDPA kernel (`megalite.model.attention`; "auto" = PyTorch's choice),
    `document_kernel` the document mask's (`megalite.model.document_attention`).
    `cp` (context parallelism): this rank holds two chunks of every sequence
    (`megalite.parallel.context_shard`) — `inputs` and `labels` are those chunks' tokens, the
    positions the chunks' global ones, attention reads the whole sequence's keys over CP.
    `recompute` re-runs blocks in backward instead of keeping their activations: every block of
    the stage, or its first `recompute_layers` (Megatron's "block" method). `offload`
    (`megalite.model.activation_offload`, shared by a stage's chunks) moves what the blocks
    after the recomputed ones save to host memory until their backward: all of them, or the
    first `offload.layers`.

    A family's stage sets `family` and implements `make_block` (the block interface: a
    module from [s(/tp), b, h] to the same, residual stream in and out), `build` (its
    modules), `block_list`, `final_norm`, `token_embedding`, `embed` and `sharding_units`.
    """

    family: Family

    def __init__(self, cfg: ModelConfig, tp_group: Optional[Group] = None,
                 sequence_parallel: bool = False, rng: Optional[RNGTracker] = None,
                 blocks: Optional[range] = None, first: bool = True, last: bool = True,
                 recompute: bool = False, compile: bool = False, attention: str = "auto",
                 recompute_layers: Optional[int] = None,
                 offload: Optional[ActivationOffload] = None,
                 cp: Optional[ContextParallel] = None, document_kernel: str = "auto",
                 expert_dispatch: Optional[TokenDispatcher] = None):
        super().__init__()
        self.cfg, self.cp, self.document_kernel = cfg, cp, document_kernel
        self.expert_dispatch = expert_dispatch  # ep > 1: the MoE layers' token exchange
        self.tp_group = tp_group if tp_group is not None else single_rank_group("tp")
        self.sequence_parallel = sequence_parallel and self.tp_group.size > 1
        self.rng, self.recompute, self.recompute_layers = rng, recompute, recompute_layers
        self.offload = offload
        self.first, self.last = first, last
        self.blocks = blocks if blocks is not None else range(cfg.n_layer)
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, self.tp_group.size)
        # MoE families: what the stage's MoE layers record (`megalite.model.moe.ledger`)
        self.routing = self.family.routing_ledger(cfg, self.blocks)
        # the weight of a training forward in the step's objective (1 / micro-batches x the
        # fp16 loss scale), set by the pipeline schedule each step: the gradient a stage without
        # the LM head sends its MoE balancing penalty (the last stage's goes with its loss)
        self.objective_scale: Optional[float] = None
        self.tp_region = rng.tp_region if rng is not None else contextlib.nullcontext
        # Dropout on the residual stream: its own masks per TP rank only when SP shards it.
        self.residual_region = self.tp_region if self.sequence_parallel \
            else contextlib.nullcontext
        self.build(attention)
        listed = dict(self.family.stage_specs(cfg, self.blocks, self.tp_group.size, first,
                                              last))
        if last:
            tied = listed["lm_head.weight"].tied and first
            self.lm_head = LMHead(self.token_embedding().weight if tied else nn.Parameter(
                torch.empty(self.padded_vocab // self.tp_group.size, cfg.n_embd)),
                self.tp_group, self.sequence_parallel)
        self.param_specs: Dict[str, ParamSpec] = self._specs(listed)
        if compile:
            # Each block's forward is compiled (fusing norms, activations, residual adds, the
            # attention reshapes); module hooks (ZeRO-3 gathering) stay in eager Python. The
            # loss is not: chunked (`megalite.parallel.cross_entropy`), it holds in eager what
            # the compiled fp32 loss held (the logits and their gradient, plus one chunk)
            for block in self.block_list():
                block.forward = torch.compile(block.forward)

    # --- what a family's stage supplies -----------------------------------------------

    @staticmethod
    def make_block(cfg: ModelConfig, tp_group: Group, sp: bool, tp_region: RegionFactory,
                   residual_region: RegionFactory, attention: str = "auto",
                   cp: Optional[ContextParallel] = None) -> nn.Module:
        """One transformer block: [s(/tp), b, h] -> [s(/tp), b, h] (`cp`: the tokens are this
        rank's CP chunks; `megalite.model.attention.causal_attention`)."""
        raise NotImplementedError

    def build(self, attention: str) -> None:
        """Make the stage's modules (embeddings when `first`, the blocks `self.blocks`, the
        final norm when `last`), registered in the order of the family's spec lists."""
        raise NotImplementedError

    def block_list(self) -> List[nn.Module]:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def token_embedding(self) -> nn.Module:
        raise NotImplementedError

    def embed(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or this rank's [s/tp, b, h] with SP); `positions`
        [b, s] restart per document (train.reset_positions), None: 0..s-1."""
        raise NotImplementedError

    def check_length(self, local_len: int) -> None:
        """A sequence (this rank's `local_len` tokens of it with CP) fits model.n_positions."""
        s = local_len * (self.cp.group.size if self.cp is not None else 1)
        if s > self.cfg.n_positions:
            raise ValueError(f"sequence length {s} > model.n_positions={self.cfg.n_positions}")

    def sharding_units(self) -> List[nn.Module]:
        """The modules ZeRO-3 gathers one at a time, in forward order."""
        raise NotImplementedError

    # --- parameter metadata -------------------------------------------------------------

    def _specs(self, listed: Dict[str, ParamSpec]) -> Dict[str, ParamSpec]:
        """Each parameter's spec from the family's list `listed` (`Family.stage_specs`; a tied
        parameter listed once), its local shape checked against the spec's split; with
        ep > 1 the routed experts' whole on each TP rank (`ParamSpec.tp_folded`)."""
        tp, ep = self.tp_group.size, self.ep_size
        specs = {}
        for name, param in self.named_parameters():
            spec = listed[name]
            if spec.expert and ep > 1:
                spec = dataclasses.replace(spec, tp_folded=True)
            if tuple(param.shape) != spec.local_shape(tp, ep):
                raise ValueError(f"{name}: local shape {tuple(param.shape)}, its spec says "
                                 f"{spec.local_shape(tp, ep)} at tp={tp}, ep={ep}")
            specs[name] = spec
        return specs

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are split over (1 without expert parallelism)."""
        return 1 if self.expert_dispatch is None else self.expert_dispatch.size

    @property
    def ep_rank(self) -> int:
        return 0 if self.expert_dispatch is None else self.expert_dispatch.group.rank

    @property
    def chunks(self) -> List["CausalLM"]:
        """The model chunks this module is made of: itself (`megalite.model.stage` holds
        several for the interleaved schedule)."""
        return [self]

    # --- forward ------------------------------------------------------------------------

    def recomputed_blocks(self) -> int:
        """How many of the chunk's first blocks re-run their forward in backward."""
        if not self.recompute:
            return 0
        n = len(self.blocks)
        return n if self.recompute_layers is None else min(self.recompute_layers, n)

    def _run_block(self, index: int, block: nn.Module, x: torch.Tensor,
                   chain: Optional[BlockChain], attn: Optional[AttentionInputs]) -> torch.Tensor:
        """Block `index` of this stage; recomputed in backward when recompute is on and the
        block is among the stage's first `recompute_layers` (all of them when None); with
        `chain` (activation offload, training) its saved tensors go to host memory when it is
        among the offloaded blocks (`offloaded_blocks`). `attn`: the micro-batch's documents
        and positions (None: causal over the window, positions 0..s-1)."""
        recomputed = self.recomputed_blocks()
        if index < recomputed and self.training and torch.is_grad_enabled():
            return recompute_block(block, x, self.rng, attn, self.routing)
        if chain is not None:  # offloaded or not: the chain keeps the blocks in transit
            return chain.run(index, block, x, attn)
        return block(x, attn)

    def logits_local(self, x: torch.Tensor) -> torch.Tensor:
        """Last stage: the final norm and the LM head -> this rank's vocabulary slice
        [s, b, V/tp]."""
        return self.lm_head(self.final_norm()(x))

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy [N] (fp32) of this rank's logits [N, V/tp] and the targets
        [N]: the chunked, vocab-parallel loss (`megalite.parallel.cross_entropy`; with tp = 1
        a group of one). Padded vocabulary columns never count; no fp32 copy of the whole
        logits is made."""
        return cross_entropy(logits, targets, self.tp_group,
                             self.tp_group.rank * logits.shape[-1], self.cfg.vocab_size)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             documents: Optional[Documents] = None) -> torch.Tensor:
        """Mean cross-entropy over all tokens; logits [s, b, V/tp], labels [b, s]. With
        `documents.counted` [b, s] (train.eos_loss=false) the counted targets' summed
        cross-entropy / `documents.loss_share` (the step's counted targets per micro-batch and
        DP x CP rank, `megalite.data.documents`: Megatron's per-token loss), or / this
        micro-batch's count where no share is set (a forward outside the trainer). A rank
        with no counted target gives 0."""
        losses = self.token_losses(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1))
        if documents is None or documents.counted is None:
            return losses.mean()
        weights = documents.counted.t().reshape(-1).to(losses.dtype)
        share = documents.loss_share
        return (losses * weights).sum() / (weights.sum().clamp(min=1.0) if share is None
                                           else share)

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
                per_sequence: bool = False, documents: Optional[Documents] = None
                ) -> torch.Tensor:
        attn = AttentionInputs.of(documents, self.document_kernel)
        positions = None if attn is None else attn.positions
        x = self.embed(inputs, positions) if self.first else inputs
        offloading = self.offload is not None and self.training and torch.is_grad_enabled()
        chain = self.offload.chain(offloaded_blocks(
            len(self.blocks), self.recomputed_blocks(), self.offload.layers),
            len(self.blocks)) if offloading else None
        if self.routing is not None:
            self.routing.open(self.training and torch.is_grad_enabled())
        for index, block in enumerate(self.block_list()):
            x = self._run_block(index, block, x, chain, attn)
        penalty = self.routing.close() if self.routing is not None else None
        if not self.last:  # the balancing penalty in the gradient the output brings back
            if penalty is not None and self.objective_scale is None:
                raise ValueError("an MoE balancing penalty on a stage without the LM head "
                                 "needs the step's objective_scale (the pipeline schedule "
                                 "sets it)")
            return with_scaled_penalty(x, penalty, self.objective_scale)
        logits = self.logits_local(x)
        if labels is not None and per_sequence:
            return self.sequence_losses(logits, labels)
        if labels is not None:  # the balancing penalty in the gradient, not in the value
            return with_penalty(self.loss(logits, labels, documents), penalty)
        return gather_vocab(logits, self.tp_group, self.cfg.vocab_size).transpose(0, 1)


def recompute_block(block: nn.Module, x: torch.Tensor, rng: Optional[RNGTracker],
                    attn: Optional[AttentionInputs] = None,
                    routing: Optional[RoutingLedger] = None) -> torch.Tensor:
    """Activation recomputation (Chen et al. 2016; Korthikanti 2022 "full" recompute): keep only
    the block's input and re-run its forward during backward. torch's checkpoint restores the
    default (replicated) RNG stream for the re-run; the TP stream is restored here, so the
    re-run draws the same dropout masks, and put back afterwards so later forwards continue
    their own stream. `attn` (the micro-batch's documents) is kept with the input. `routing`
    (a stage with MoE layers): the re-run computes the balancing terms again, as the forward
    did, and records nothing (`RoutingLedger.rerun`)."""
    snapshot = rng.tp_state() if rng is not None else None
    calls = [0]

    def run(inp: torch.Tensor, attn: Optional[AttentionInputs]) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 1:
            return block(inp, attn)
        with contextlib.ExitStack() as rerun:
            if rng is not None:
                current = rng.tp_state()
                rng.set_tp_state(snapshot)
                rerun.callback(rng.set_tp_state, current)
            if routing is not None:
                rerun.enter_context(routing.rerun())
            return block(inp, attn)

    return checkpoint(run, x, attn, use_reentrant=False)
