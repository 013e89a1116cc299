"""The sizes every term of a layout's plan is built from (`megalite.plan.memory`'s docstring
has the formulas): the compute dtype's bytes, the padded vocabulary, a rank's sequence
positions (s/cp) and the residual stream's (s/cp, /t with SP), the micro-batches, one block's
activation bytes (the model family's at s/cp positions, `megalite.model.family`, + CP
attention's own, `megalite.plan.cp_terms`) and parameters per TP rank, and how many of a
chunk's blocks are recomputed or offloaded. A model whose blocks differ (an MoE model's dense
first blocks, `model.moe.first_dense_layers` / `layer_freq`) has each block's own terms
(`Dims.of`); `Dims.block` / `layer_act_full` are those of its typical block (the first MoE
block where there is one: the largest)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.model.activation_offload import offloaded_blocks
from megalite.model.families import family
from megalite.model.family import Family, Specs, local_numel
from megalite.parallel.cross_entropy import chunk_rows
from megalite.parallel.param_spec import padded_vocab_size
from megalite.plan import cp_terms


def ring(n: int) -> float:
    return (n - 1) / n


def math_attention(cfg: Config, layout: Layout) -> bool:
    """Whether SDPA runs its math kernel: asked for, or attention dropout on a CPU (whose
    flash kernel has no dropout)."""
    return cfg.train.attention == "math" or (layout.device_type == "cpu"
                                             and cfg.model.attn_pdrop > 0)


def loss_bytes(tokens: int, cols: int, e: int, tp: int) -> Dict[str, float]:
    """The chunked cross-entropy's bytes on one rank (`megalite.parallel.cross_entropy`) for
    `tokens` tokens and `cols` columns of e-byte logits:

      saved     e·N·C the logits (the LM head's output, kept for the backward) + per token
                the local targets (8), their mask (1), the max (4) and log-sum-exp (4;
                with TP the max is a copy and the (target logit, sum) pair of 8 holds it)
      forward   one fp32 chunk, 4·R·C (R = min(N, `chunk_rows(C)`)) + 4 fp32 [N] vectors
      backward  the gradient of the logits e·N·C + one fp32 chunk + 2 fp32 [N] vectors

    `forward` / `backward`: what each adds at its peak to the saved bytes."""
    chunk = 4 * min(tokens, chunk_rows(cols)) * cols
    return {"saved": e * tokens * cols + (17 if tp == 1 else 21) * tokens,
            "forward": chunk + 16 * tokens,
            "backward": e * tokens * cols + chunk + 8 * tokens}


def recomputed_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a stage's blocks re-run their forward in backward."""
    if not cfg.train.recompute:
        return 0
    limit = cfg.train.recompute_layers
    return stage_layers if limit is None else min(limit, stage_layers)


def offloaded_layers(cfg: Config, stage_layers: int) -> int:
    """How many of a chunk's blocks keep their saved tensors in host memory."""
    if not cfg.offload.activations:
        return 0
    return len(offloaded_blocks(stage_layers, recomputed_layers(cfg, stage_layers),
                                cfg.offload.activations_layers))


@dataclass(frozen=True)
class ParamSums:
    """What a list of parameters (a family's spec list) adds up to on one TP rank."""

    numel: int  # elements
    replicated: int  # of which TP-replicated (norms, row-parallel biases, positions)
    decayed: int  # of which with weight decay (matrices, embeddings)
    split: int  # of which split over TP (what a zero-bubble W computes the gradient of)
    largest: int  # elements of the largest one
    units: List[int]  # each parameter's elements, in registration order
    # slots of the TP-shared slices' gradient sum (`sum_tp_shares`): tp / tp_replicas slots of
    # each shared parameter's elements (grouped-query attention's K, V with tp > n_kv_head)
    shared_slots: int = 0
    expert: int = 0  # of which routed experts split over EP (their E/ep a rank; 0 at ep = 1,
    #                  where the experts are reduced and sharded with the rest over DP x CP)


def param_sums(specs: Specs, tp: int, ep: int = 1) -> ParamSums:
    """`specs` on one TP rank (and one EP rank: a routed expert weight's E/ep experts, whole:
    EP folds over TP, expert TP = 1)."""
    sizes = [(local_numel(s, 1) // ep if s.expert and ep > 1 else local_numel(s, tp), s)
             for _, s in specs]
    return ParamSums(numel=sum(n for n, _ in sizes),
                     replicated=sum(n for n, s in sizes if s.tp_replicated),
                     decayed=sum(n for n, s in sizes if s.weight_decay),
                     split=sum(n for n, s in sizes if not s.tp_replicated),
                     largest=max((n for n, _ in sizes), default=0), units=[n for n, _ in sizes],
                     shared_slots=sum(n * tp // s.tp_replicas for n, s in sizes
                                      if s.tp_replicas > 1),
                     expert=sum(n for n, s in sizes if s.expert) if ep > 1 else 0)


@dataclass(frozen=True)
class BlockTerms:
    """One block's parameters on one TP (and EP) rank and the activation bytes it keeps."""

    params: ParamSums
    act: float  # bytes it keeps for backward per micro-batch (no recompute)
    moe: bool  # it has an MoE layer (`model.moe.is_moe_layer`)
    backward: float  # its backward's bytes beyond its saved set (the MLP's gradients)


@dataclass(frozen=True)
class Dims:
    """The sizes every term of a plan is built from."""

    cfg: Config
    layout: Layout
    e: int  # bytes of the compute dtype
    vocab: int  # padded vocabulary
    s_rank: int  # sequence positions per rank: s/cp
    s_local: int  # positions of the residual stream per rank (s/cp, /t with SP)
    micro: int  # micro-batches per step
    layer_act_full: float  # activation bytes the typical block keeps (no recompute)
    layer_params: int  # parameter elements of the typical block on one TP rank (and EP rank)
    full: float  # bytes of one full activation of the rank's positions [s/cp, b, h]
    family: Family  # the model's family: its parameter lists and activation terms
    block: ParamSums  # the typical block's parameters on one TP rank
    embeddings: ParamSums  # the first stage's (the token embedding first)
    final_norm: ParamSums  # the last stage's final norm
    kinds: Dict[bool, BlockTerms]  # by `moe`: each kind of block the model has

    def of(self, index: int) -> BlockTerms:
        """Block `index`'s terms."""
        return self.kinds[is_moe_block(self.cfg, index)]


def is_moe_block(cfg: Config, index: int) -> bool:
    moe = cfg.model.moe
    return moe.enabled and moe.is_moe_layer(index)


def typical_block(cfg: Config) -> int:
    """The block whose terms stand for every block (the first MoE block, else block 0)."""
    return next((i for i in range(cfg.model.n_layer) if is_moe_block(cfg, i)), 0)


def layer_activation_bytes(cfg: Config, layout: Layout, e: int,
                           index: Optional[int] = None) -> float:
    """Bytes block `index` (default: the typical block) keeps for backward per micro-batch
    on one rank: the family's at the rank's s/cp positions, + what CP attention saves beyond
    it (`cp_terms.saved_bytes`)."""
    m, t = cfg.model, cfg.train
    return family(m).block_activation_bytes(
        m, typical_block(cfg) if index is None else index, t.seq_len // layout.cp_size,
        t.micro_batch_size, layout.tp_size, layout.sequence_parallel, e, m.resid_pdrop > 0,
        math_attention(cfg, layout), layout.ep_size) + cp_terms.saved_bytes(cfg, layout, e)


def _block_terms(cfg: Config, layout: Layout, e: int, index: int) -> BlockTerms:
    m, tp = cfg.model, layout.tp_size
    fam = family(m)
    return BlockTerms(params=param_sums(fam.block_specs(m, index, tp), tp, layout.ep_size),
                      act=layer_activation_bytes(cfg, layout, e, index),
                      moe=is_moe_block(cfg, index),
                      backward=fam.block_backward_bytes_of(
                          m, index, cfg.train.seq_len // layout.cp_size,
                          cfg.train.micro_batch_size, tp, e, layout.sequence_parallel,
                          layout.ep_size))


def dims(cfg: Config, layout: Layout) -> Dims:
    m, t, tp = cfg.model, cfg.train, layout.tp_size
    e = 4 if layout.precision == "fp32" else 2
    fam = family(m)
    s_rank = t.seq_len // layout.cp_size
    firsts = {False: 0}  # the first block of each kind
    if m.moe.enabled:
        firsts = {}
        for i in range(m.n_layer):
            firsts.setdefault(is_moe_block(cfg, i), i)
    kinds = {moe: _block_terms(cfg, layout, e, i) for moe, i in firsts.items()}
    typical = kinds[True in kinds]
    return Dims(
        cfg=cfg, layout=layout, e=e, vocab=padded_vocab_size(m.vocab_size, tp),
        s_rank=s_rank, s_local=layout.activation_seq_len(t.seq_len),
        micro=layout.micro_batches(t.global_batch_size),
        layer_act_full=typical.act, layer_params=typical.params.numel,
        full=e * s_rank * t.micro_batch_size * m.n_embd, family=fam, block=typical.params,
        embeddings=param_sums(fam.first_specs(m, tp), tp),
        final_norm=param_sums(fam.final_norm_specs(m, tp), tp), kinds=kinds)


def tp_collectives(cfg: Config, layout: Layout, chunks: List[range], first: bool,
                   last: bool) -> float:
    """A stage's TP collectives per micro-batch (the plan's count: 4 all-reduces a layer, with
    SP 6 all-gathers + 4 reduce-scatters; a recomputed layer's re-run 1, with SP 3; the
    embedding and the head + loss a few more)."""
    if layout.tp_size == 1:
        return 0.0
    layers = sum(len(b) for b in chunks)
    rec = sum(recomputed_layers(cfg, len(b)) for b in chunks)
    per_layer, rerun = ((10, 3) if layout.sequence_parallel else (4, 1))
    return layers * per_layer + rec * rerun + 2 * first + 4 * last \
        + moe_tp_collectives(cfg, layout, chunks)


def moe_tp_collectives(cfg: Config, layout: Layout, chunks: List[range]) -> int:
    """What a stage's MoE layers (SP) launch over TP beyond the dense MLP's 5 a layer (1 a
    re-run), as `megalite.plan.stage_terms.moe_tp_bytes` counts their bytes: TP-split experts
    7 (the tokens', choices' and weights' gathers, the outputs' reduce-scatter, the backward's
    three), a re-run 3; EP folded over TP the choices' gather, + the shared experts' 4 (a
    re-run 1, + their 2)."""
    moe = cfg.model.moe
    if not moe.enabled or not layout.sequence_parallel:
        return 0
    shared = 4 if moe.shared_experts else 0
    per_layer, rerun = (1 + shared - 5, 1 + shared // 2 - 1) if layout.ep_size > 1 else (2, 2)
    return sum((per_layer + (rerun if j < recomputed_layers(cfg, len(b)) else 0))
               for b in chunks for j, i in enumerate(b) if moe.is_moe_layer(i))
