"""The memory plan's peak (`megalite.plan.memory`, whose docstring has the terms P, G, O, A):
what is alive at each moment where a stage's memory can peak, the largest of them
(`StagePlan.moments`, `peak_at`; `bytes` lists the peak moment's terms, which add up to its
total; W = the moment's working bytes):

  forward         P + G + O + A (the last forward in flight done) + the loss's forward chunk
                  (4·R·C, R = min(n, `chunk_rows(C)`) tokens), or fp8.recipe's largest
                  forward product's copies if larger (`megalite.plan.fp8_terms`: the casts'
                  fp32 staging and FP8 operands; on a CPU the emulated kernel's fp32 copies)
                  + zero 2/3's reductions of the previous backward, folded in only before the
                  next backward
  loss backward   P + G + O + A + the gradient of the logits e·n·C + one fp32 chunk 4·R·C
                  (a stage without the loss: the received gradient e·s'bh); no staging
  backward        P + G + O + the staging of each bucket as it fills and launches
                  (`zero_table.staging_alive`) beside what is still saved then (A less the
                  loss's bytes and the blocks already done, + a re-run block's full set) and,
                  while blocks remain, a block's backward: GELU's gradient e·s·b·f/t beyond the
                  block's saved set, the head's weight gradient e·C·h where the stage also holds
                  the embedding (autograd accumulates the tied parameter's two gradients once),
                  the received gradient, + fp8.recipe's largest dx or dW product's copies;
                  zero-bubble schedules: a W's weight gradients of its chunk, all computed
                  before autograd accumulates them
  optimizer step  P + G + O + AdamW's temporaries: none on CUDA (fused AdamW); on a CPU,
                  foreach AdamW's sqrt(v) of its larger parameter group (4 bytes an element)
                  and, before it, `_foreach_norm`'s fp64 copy of the largest piece (8 bytes)

  ZeRO-3 gathered: the chunk's last unit, kept from its forward into its backward (the LM
              head at the loss), the unit running and the one prefetched in the backward, a
              tied embedding kept until its gradient is whole, + one block per further chunk;
              or every unit, e·Ψ, with parallel.reshard_after_forward=false (N = 1 as well:
              the engine gathers by copying)
  staging     zero 2/3: a filling bucket's fp32 gradient 4B, each launched reduce-scatter's
              input (4B, kept by the collective until waited for; not at N = 1) and output
              (4B/N), at most REDUCTIONS_IN_FLIGHT launched; zero 1: the outputs 4B/N of the
              step's last backward; on a CPU gloo's reduce-scatter also copies its input (4B)
  CPU         the tensors a pipeline stage sent in rounds that receive nothing stay until the
              step's end (gloo reports a send complete only once waited for)
"""
from __future__ import annotations

from typing import Dict, Tuple

from megalite.plan import cp_terms
from megalite.plan.dims import Dims
from megalite.plan.fp8_terms import fp8_working_bytes
from megalite.plan.offload import owned_elements
from megalite.plan.stage_terms import StageSums, dispatch_working_bytes
from megalite.plan.zero_table import staging_alive

MOMENTS = ("forward", "loss backward", "backward", "optimizer step")


def _zero3_gathered(d: Dims, sums: StageSums, loss_last: bool) -> Dict[str, float]:
    """ZeRO-3's gathered parameter bytes at each moment (0 without ZeRO-3)."""
    lay, e, v, layer = d.layout, d.e, d.layout.virtual_stages, d.layer_params
    if not lay.shards_parameters:
        return {name: 0.0 for name in MOMENTS}
    if not d.cfg.parallel.reshard_after_forward:  # every unit, from its first use
        gathered = {name: e * sums.psi for name in MOMENTS[:3]}
        gathered["optimizer step"] = 0.0
        return gathered
    # the chunk's last unit (kept from forward into backward), + another chunk's each
    end = d.vocab // lay.tp_size * d.cfg.model.n_embd if loss_last else layer
    return {"forward": e * (end + (v - 1) * layer),
            "loss backward": e * (end + (layer if not loss_last else 0) + (v - 1) * layer),
            # the unit running and the one prefetched; the tied embedding of a stage that
            # holds both ends stays gathered until its gradient is whole
            "backward": e * (2 * layer + sums.tied_head + (v - 1) * layer),
            "optimizer step": 0.0}


def stage_moments(d: Dims, sums: StageSums, chunks, states: Dict[str, float],
             activations: float, sent: float) -> Dict[str, Dict[str, float]]:
    """What the stage's rank holds at each moment where its memory can peak (the module
    docstring): the model states always; activations, ZeRO-2/3 staging, ZeRO-3's gathered
    units and the working bytes of the moment (`sent`: pipeline sends a CPU backend keeps
    until the step's end)."""
    lay, e, t = d.layout, d.e, d.cfg.train
    loss_last = any(ends.last for ends, _ in chunks)
    timeline, pending = staging_alive(d, chunks)
    block = _block_backward_bytes(d, sums)
    gathered = _zero3_gathered(d, sums, loss_last)
    freed = min(sums.chunk_freed)  # the loss's saved bytes, freed before weights' gradients
    # a stage without the loss runs its backward from a received gradient (e·s'bh)
    received = 0.0 if loss_last else e * d.s_local * t.micro_batch_size * d.cfg.model.n_embd
    # during the backward: each bucket's staging beside what is still saved by then (the
    # loss's bytes and the blocks already done freed; a recomputed block re-run) and, while
    # blocks remain, a block's working bytes (below)
    rerun = max(sums.chunk_rerun)
    fp8 = fp8_working_bytes(d.cfg, lay, e) if sums.blocks else {"forward": 0.0,
                                                                 "backward": 0.0}
    block_work = e * sums.tied_head + (block + fp8["backward"] if sums.blocks else 0.0) \
        + received
    if lay.pp_size > 1 and d.cfg.parallel.schedule in ("zb-h1", "zb-v"):
        # a W holds all its chunk's weight gradients at once before handing them to
        # autograd's accumulation (`megalite.parallel.weight_grad.run_weight_grads`)
        block_work = max(block_work, e * max(sums.chunk_weight_grads) + received)

    def during_backward(staged: float, c: int, done: int, units: float
                        ) -> Tuple[float, float, float, float]:
        remaining = done < len(sums.chunk_blocks[c])
        return (staged, activations - freed - sum(sums.chunk_blocks[c][:done])
                + (rerun if remaining else 0.0), block_work if remaining else 0.0,
                gathered["backward"] if not lay.shards_parameters
                or not d.cfg.parallel.reshard_after_forward else e * units)

    staged, left, working, gathered["backward"] = max(
        (during_backward(*point) for point in timeline), key=sum,
        default=(0.0, activations - freed + rerun, block_work, gathered["backward"]))
    moments = {
        "forward": {"grad_staging": pending, "activations": activations,
                    "working": max(max(sums.chunk_forward_work), fp8["forward"]) + sent},
        "loss backward": {"grad_staging": 0.0, "activations": activations,
                          "working": max(sums.chunk_backward_work) + sent},
        # a block's backward: the gradient of the MLP's hidden activation beside its input
        # (GELU's backward; e·s·b·f/t more than the block's saved set); the head's weight
        # gradient of a stage that also holds the embedding waits in autograd for the
        # embedding's, to be accumulated once
        "backward": {"grad_staging": staged, "activations": left, "working": working + sent},
        "optimizer step": {"grad_staging": 0.0, "activations": 0.0,
                           "working": _optimizer_work(d, sums)},
    }
    out = {}
    for name, terms in moments.items():
        out[name] = {**states, "grad_staging": terms["grad_staging"],
                     "activations": terms["activations"], "zero3_gathered": gathered[name],
                     "working": terms["working"]}
        out[name]["total"] = sum(out[name].values())
    return out


def _block_backward_bytes(d: Dims, sums: StageSums) -> float:
    """A block's backward beyond its saved set: the MLP's gradients (the stage's largest
    block's), CP attention's working bytes (`cp_terms.working_bytes`) or EP's exchange
    (`dispatch_working_bytes`, where the stage has an MoE layer), the largest."""
    lay = d.layout
    exchange = dispatch_working_bytes(d) if lay.ep_size > 1 and sums.moe_layers else 0.0
    return max(sums.block_backward, cp_terms.working_bytes(d.cfg, lay, d.e)["backward"],
               exchange)


def _optimizer_work(d: Dims, sums: StageSums) -> float:
    """The optimizer step's temporaries on the device. CUDA: none (fused AdamW; the fp64
    gradient norm of `_foreach_norm` accumulates without copies). CPU: foreach AdamW's
    sqrt(v) of one parameter group (4 bytes per element of the larger group: the decayed
    matrices and embeddings, or the rest) and, before it, the fp64 copy `_foreach_norm`
    makes of one piece at a time for the gradient norm (8 bytes per element of the largest)."""
    if d.layout.device_type == "cuda":
        return 0.0
    lay = d.layout
    owned = owned_elements(lay, 1.0) * (1 - d.cfg.offload.optimizer)
    group = max(sums.decayed, sums.psi - sums.decayed) * owned
    piece = sums.largest_param * (owned if lay.shards_optimizer else 1)
    return max(4 * group, 8 * piece)
