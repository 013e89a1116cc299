"""The training and scoring loss: token cross-entropy of logits split over the vocabulary (one
TP rank's columns; tp = 1 is a group of one), computed in chunks of tokens so that no fp32 copy
of the whole logits ever exists (llm.c's fused classifier, Liger's fused linear cross-entropy).

    loss_i = log sum_j exp(z_ij - M_i) - (z_i,t_i - M_i)      M_i = max_j z_ij

Forward, chunk by chunk of CHUNK_BYTES of fp32 logits: the chunk upcast (shifted by its rows'
local max), exponentiated and summed; the target logits gathered at once. Then two all-reduces
over TP for all tokens (not per chunk): the max, and (target logit, sum of exponentials
rescaled to the global max) in one message. Saved for backward: the logits as given (bf16,
fp16 or fp32: the LM head's output, which no other node keeps), the targets, and per token the
global max and log-sum-exp (fp32 [N]).

Backward, chunk by chunk again: softmax = exp(z - (M + lse)) recomputed in fp32 from the saved
logits, times the incoming per-token gradient, minus it at the target, written into a gradient
of the logits' own dtype (one rounding, as `F.cross_entropy(logits.float())`'s cast back did).
An ordinary autograd backward: under a zero-bubble schedule the LM head's weight gradient still
defers to W (`megalite.parallel.weight_grad`).

Padded vocabulary columns (`vocab_size` .. padded) never count: the padding is the end of the
vocabulary, so a rank's real columns are its first `valid` ones; the rest get gradient 0 (a
rank holding only padding contributes a max of -inf and a sum of 0).

Memory (bytes; N tokens, C = V/t columns of this rank, e the logits' dtype): the loss itself
saves nothing beyond the logits it is given (e·N·C, alive anyway as the LM head's output) and
16·N; its forward adds one fp32 chunk (4·R·C, R = `chunk_rows(C)` tokens); its backward the
gradient of the logits (e·N·C, which the LM head's backward reads) and one fp32 chunk. The
fp32 path this replaces held three fp32 [N, C] buffers at its backward (the saved
log-probabilities, the NLL gradient and log_softmax's backward output); `megalite.plan`
counts these terms (`megalite.plan.dims.loss_bytes`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.group import Group

# fp32 bytes of one chunk of logits: large enough that a chunk's kernels run at full rate on a
# GPU (256 MiB = 67M elements, ~1,300 tokens of GPT-2's 50,304 columns; a kernel that size
# takes ~0.1 ms at HBM bandwidth, far above launch latency), small enough that it is a few
# percent of a step's activations; a tiny vocabulary gets one chunk
CHUNK_BYTES = 256 * 2**20


def chunk_rows(cols: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk for `cols` columns: as many as fit `chunk_bytes` of fp32."""
    return max(1, chunk_bytes // (4 * max(cols, 1)))


def _upcast(z: torch.Tensor) -> tuple:
    """(z in fp32, whether that is a copy): the copy of a bf16/fp16 chunk is the chunk's one
    fp32 buffer, worked on in place; fp32 logits are not copied (nor modified)."""
    z32 = z.float()
    return z32, z32.data_ptr() != z.data_ptr()


def _shifted_fp32(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """z - shift[:, None] in fp32, in one fp32 buffer of the chunk's size on any device
    (`z - shift` with a bf16 z would on the CPU make an fp32 copy of z as well: TensorIterator
    casts a CPU operation's inputs to the common dtype first)."""
    z32, copied = _upcast(z)
    return z32.sub_(shift.unsqueeze(-1)) if copied else z32 - shift.unsqueeze(-1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses [N] (fp32) of logits [N, C] split over the vocabulary (the module
    docstring); `rows` tokens per chunk."""

    @staticmethod
    def forward(ctx, logits, target, group: Group, vocab_start: int, vocab_size: int,
                rows: int):
        n, cols = logits.shape
        valid = max(0, min(cols, vocab_size - vocab_start))  # real (unpadded) columns
        f32 = dict(dtype=torch.float32, device=logits.device)
        local_max = torch.full((n,), float("-inf"), **f32)
        sum_exp = torch.zeros(n, **f32)
        local_t = target - vocab_start
        inside = (local_t >= 0) & (local_t < valid)
        local_t = local_t.masked_fill(~inside, 0)
        target_logit = torch.zeros(n, **f32)
        if valid:
            real = logits[:, :valid]
            for lo in range(0, n, rows):
                z, copied = _upcast(real[lo:lo + rows])
                m = z.amax(dim=-1)
                local_max[lo:lo + rows] = m
                shifted = z.sub_(m.unsqueeze(-1)) if copied else z - m.unsqueeze(-1)
                sum_exp[lo:lo + rows] = shifted.exp_().sum(dim=-1)
                del z, shifted
            target_logit = logits.gather(1, local_t.unsqueeze(-1)).squeeze(-1).float() \
                .masked_fill_(~inside, 0.0)
        if group.size > 1:  # one message each over all tokens
            global_max = local_max.clone()
            comm.all_reduce(global_max, group, op=dist.ReduceOp.MAX)
            sum_exp.mul_((local_max - global_max).exp_())  # -inf - M: a padding-only rank's 0
            reduced = torch.stack([target_logit, sum_exp])
            comm.all_reduce(reduced, group)
            target_logit, sum_exp = reduced[0], reduced[1]
        else:
            global_max = local_max
        lse = sum_exp.log_()  # log sum_j exp(z_ij - M_i)
        loss = lse - (target_logit - global_max)
        ctx.save_for_backward(logits, local_t, inside, global_max, lse)
        ctx.valid, ctx.rows = valid, rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_t, inside, global_max, lse = ctx.saved_tensors
        valid, rows = ctx.valid, ctx.rows
        n, cols = logits.shape
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        if valid < cols:
            grad[:, valid:].zero_()
        g = grad_loss.float()
        at_target = (-g).masked_fill_(~inside, 0.0).unsqueeze(-1)
        shift = global_max + lse  # log sum_j exp(z_ij): softmax = exp(z - shift)
        for lo in range(0, n if valid else 0, rows):
            hi = min(lo + rows, n)
            p = _shifted_fp32(logits[lo:hi, :valid], shift[lo:hi])
            p.exp_().mul_(g[lo:hi].unsqueeze(-1))
            p.scatter_add_(1, local_t[lo:hi].unsqueeze(-1), at_target[lo:hi])
            grad[lo:hi, :valid].copy_(p)  # the one rounding to the logits' dtype
            del p
        return grad, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                  vocab_start: int, vocab_size: int, rows: int = 0) -> torch.Tensor:
    """Per-token losses [N] (fp32) from this rank's logits [N, C] (columns vocab_start ...,
    any float dtype) and the targets [N] (each in [0, vocab_size)); `vocab_size` is the real
    (unpadded) vocabulary; `rows` tokens per chunk (default: `chunk_rows(C)`)."""
    rows = rows or chunk_rows(logits.shape[-1])
    return _ChunkedCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, rows)
