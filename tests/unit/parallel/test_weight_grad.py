"""The B/W split of megalite's layers (zero-bubble schedules): B gives the input gradient of
nn.Linear / nn.Embedding, W later the weight gradient, also when other micro-batches' B ran in
between; without an open queue the layers compute both at once."""
from __future__ import annotations

import torch
import torch.nn as nn

from megalite.model.causal_lm import LMHead
from megalite.parallel.group import single_rank_group
from megalite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.parallel.weight_grad import (
    WeightGradQueue,
    attach_weight_grad_queue,
    run_weight_grads,
)


def _pair(layer_cls, bias=True):
    """A megalite layer (tp = 1) and an nn.Linear with the same weights."""
    torch.manual_seed(0)
    layer = layer_cls(8, 6, single_rank_group("tp"), False, bias=bias)
    ref = nn.Linear(8, 6, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        ref.weight.copy_(layer.weight)
        if bias:
            layer.bias.normal_()
            ref.bias.copy_(layer.bias)
    return layer, ref


def _check_split(layer, ref, make_input, reference_forward):
    """Two micro-batches: B0, B1, then W1, W0 (W after another micro-batch's B)."""
    queue = WeightGradQueue()
    attach_weight_grad_queue(layer, queue)
    inputs = [make_input(i) for i in range(2)]
    deferred, grads_in = [], []
    for i, x in enumerate(inputs):
        y = layer(x)
        dy = torch.randn_like(y, generator=torch.Generator().manual_seed(10 + i))
        with queue.collecting() as w:
            y.backward(dy)
        deferred.append(w)
        grads_in.append(None if not x.requires_grad else x.grad.clone())
        assert layer.weight.grad is None  # W not run yet (a row-parallel bias: in B)
    run_weight_grads(deferred[1])
    run_weight_grads(deferred[0])
    for i, x in enumerate(inputs):
        xr = x.detach().requires_grad_(x.requires_grad)
        y = reference_forward(ref, xr)
        y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(10 + i)))
        if xr.requires_grad:
            torch.testing.assert_close(grads_in[i], xr.grad, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return queue


def _activation(i):
    return torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(i)).requires_grad_()


def test_column_and_row_parallel_linears_split_backward():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for bias in (True, False):
            layer, ref = _pair(cls, bias)
            _check_split(layer, ref, _activation, lambda r, x: r(x))


def test_lm_head_and_embedding_split_backward():
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(16, 8, single_rank_group("tp"), False)
    nn.init.normal_(emb.weight)
    ref = nn.Embedding(16, 8)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    # repeated ids: their rows' gradients add up
    _check_split(emb, ref, lambda i: torch.randint(0, 16, (5, 3), generator=torch.Generator()
                                                   .manual_seed(i)), lambda r, x: r(x))
    head_weight = nn.Parameter(torch.randn(16, 8))
    head = LMHead(head_weight, single_rank_group("tp"), False)
    lin = nn.Linear(8, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(head_weight)
    _check_split(head, lin, _activation, lambda r, x: r(x))


def test_without_an_open_queue_gradients_come_at_once():
    """A queue attached but not collecting (evaluation, a non-split backward): W runs in B."""
    layer, ref = _pair(ColumnParallelLinear)
    attach_weight_grad_queue(layer, WeightGradQueue())
    x = _activation(0)
    layer(x).sum().backward()
    ref(x.detach()).sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)


def test_weight_gradients_reach_the_parameters_hooks_once_per_micro_batch():
    """A parameter used twice in one micro-batch (a tied weight) is accumulated once, with the
    sum: post-accumulate hooks (the ZeRO engine's buckets) count one report per micro-batch."""
    layer, _ = _pair(ColumnParallelLinear, bias=False)
    queue = WeightGradQueue()
    attach_weight_grad_queue(layer, queue)
    reports = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: reports.append(p.grad.clone()))
    x = _activation(0)
    with queue.collecting() as w:
        (layer(x) + layer(x)).sum().backward()
    assert reports == [] and len(w) == 2
    run_weight_grads(w)
    assert len(reports) == 1
    ref = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
    (ref(x.detach()) * 2).sum().backward()
    torch.testing.assert_close(reports[0], ref.weight.grad)


def test_no_parameter_hook_fires_in_b():
    """B leaves the deferred parameters alone: their accumulation hooks fire only in W."""
    fired = []
    emb = VocabParallelEmbedding(16, 8, single_rank_group("tp"), False)
    layer, _ = _pair(ColumnParallelLinear)
    queue = WeightGradQueue()
    for module in (emb, layer):
        attach_weight_grad_queue(module, queue)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    out = layer(emb(torch.randint(0, 16, (5, 3))))
    with queue.collecting() as w:
        out.sum().backward()
    assert fired == [] and len(w) == 2
    run_weight_grads(w)
    assert fired == [True] * 3
