"""The backward split in two for zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", §2): B computes a layer's input gradient — what the previous layer and
the previous pipeline stage wait for — and W its weight gradient, which only the optimizer
needs and which the schedule runs later, in slots where the stage would otherwise idle.

The executor owns one `WeightGradQueue` per model chunk and opens it around each B; the layers
that hold the model's matmul weights (`megalite.parallel.tensor`: column- and row-parallel
linears, the vocab-parallel embedding and the LM head; `attach_weight_grad_queue` hands them the
queue) then return only their input gradient and push a closure that computes the weight
gradient. The closures of one (chunk, micro-batch) run at its W (`run_weight_grads`), which
hands their gradients to autograd as if they came from the backward (`torch.autograd.backward`
on the leaf parameters: the parameters' gradient accumulation and its hooks — the ZeRO engine's
buckets — run exactly as in an unsplit backward, only later). LayerNorm parameters, the position
embedding and the row-parallel bias (added after the TP reduction) get their gradient in B: they
are cheap and their hooks count per micro-batch like the others (`ZeroEngine`).

A closure holds what its weight gradient needs: the layer input and the output gradient (never
the weight). It holds them as tensors of its own, so under activation recomputation W reads
the recomputed input that B unpacked, not storage the recompute graph frees after B. Without a
queue, or with the queue closed (no zero-bubble schedule, evaluation), a layer computes both
gradients at once, as an unsplit backward does.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

# a deferred W: computes (parameter, its gradient) pairs
WeightGrad = Callable[[], Sequence[Tuple[nn.Parameter, torch.Tensor]]]


class WeightGradQueue:
    """The deferred weight gradients of one model chunk while a B runs (`collecting`)."""

    def __init__(self) -> None:
        self._open: Optional[List[WeightGrad]] = None

    @contextlib.contextmanager
    def collecting(self) -> Iterator[List[WeightGrad]]:
        """While open, layers defer their weight gradients into the yielded list."""
        self._open = []
        try:
            yield self._open
        finally:
            self._open = None

    def defer(self, weight_grad: WeightGrad) -> bool:
        """Queue `weight_grad` if a B is collecting; False: compute it now."""
        if self._open is None:
            return False
        self._open.append(weight_grad)
        return True


def attach_weight_grad_queue(chunk: nn.Module, queue: WeightGradQueue) -> None:
    """Give every layer of `chunk` that can defer its weight gradient the chunk's queue."""
    for module in chunk.modules():
        if hasattr(module, "weight_grad_queue"):
            module.weight_grad_queue = queue


def run_weight_grads(weight_grads: Sequence[WeightGrad]) -> None:
    """Compute the deferred weight gradients of one (chunk, micro-batch) and accumulate them
    into the parameters through autograd (one accumulation per parameter: a parameter that two
    layers use gets the sum, as in one backward)."""
    params: Dict[int, nn.Parameter] = {}
    grads: Dict[int, torch.Tensor] = {}
    with torch.no_grad():  # as inside a backward: the gradients build no graph
        pairs = [pair for weight_grad in weight_grads for pair in weight_grad()]
    for p, g in pairs:
        if id(p) in grads:
            grads[id(p)] = grads[id(p)] + g
        else:
            params[id(p)], grads[id(p)] = p, g
    if params:
        torch.autograd.backward(tuple(params.values()), tuple(grads[k] for k in params))


def linear_weight_grads(grad: torch.Tensor, x: torch.Tensor, weight: nn.Parameter,
                        bias: Optional[nn.Parameter]) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """dW = dy^T x and db = sum dy over all positions, for y = x W^T + b."""
    g2 = grad.reshape(-1, grad.shape[-1])
    out = [(weight, g2.t().matmul(x.reshape(-1, x.shape[-1])))]
    if bias is not None:
        out.append((bias, g2.sum(0)))
    return out


def split_linear(x: torch.Tensor, weight: nn.Parameter, bias: Optional[nn.Parameter],
                 queue: WeightGradQueue) -> torch.Tensor:
    """y = x W^T + b with dW, db deferred to the schedule's W while `queue` collects."""
    return _SplitLinear.apply(x, weight.detach(), None if bias is None else bias.detach(),
                              (weight, bias), queue)


def split_embedding(ids: torch.Tensor, weight: nn.Parameter, queue: WeightGradQueue
                    ) -> torch.Tensor:
    """F.embedding(ids, W) with dW deferred to the schedule's W while `queue` collects. Token
    ids need no gradient and W enters detached: an empty tensor that requires a gradient (and
    gets none) makes autograd run this backward at all."""
    anchor = torch.empty(0, device=ids.device, requires_grad=True)
    return _SplitEmbedding.apply(ids, weight.detach(), (weight,), queue, anchor)


def defer_or_run(queue: WeightGradQueue, weight_grad: WeightGrad) -> None:
    """Queue a weight gradient for W, or (no B collecting) accumulate it now."""
    if not queue.defer(weight_grad):
        run_weight_grads([weight_grad])


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx = dy W in B and defers dW, db to W.

    The parameters enter detached (autograd would otherwise run their gradient accumulation,
    and its hooks, with no gradient at B); W accumulates into them (`run_weight_grads`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, params, queue: WeightGradQueue):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.queue = params, queue
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w, b = ctx.params
        defer_or_run(ctx.queue, lambda: linear_weight_grads(grad, x, w, b))
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class _SplitEmbedding(torch.autograd.Function):
    """F.embedding(ids, W) whose weight gradient (the rows of dy added at the ids) is deferred
    to W; there is no input gradient, so its B is empty."""

    @staticmethod
    def forward(ctx, ids, weight, param, queue: WeightGradQueue, anchor):
        ctx.save_for_backward(ids)
        (ctx.param,), ctx.queue = param, queue
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        param = ctx.param
        defer_or_run(ctx.queue, lambda: [(param, torch.ops.aten.embedding_dense_backward(
            grad, ids, param.shape[0], -1, False))])
        return None, None, None, None, None
