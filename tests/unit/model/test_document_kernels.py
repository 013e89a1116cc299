"""The document mask's kernels against each other on CPU: the variable-length path
(`train.document_kernel=varlen`) packs the micro-batch into one sequence cut at every document
and window start and unpacks the result, here with CUDA's kernel stood in for by causal SDPA
on each piece (called with varlen_attn's own signature); its outputs and q/k/v gradients equal
the boolean-mask SDPA path (fp64, 1e-12), with and without grouped-query heads. The kernels
themselves on a GPU: tests/unit/model/test_cuda_document_attention.py."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import varlen

from megalite.config.document_kernel import resolved_document_kernel
from megalite.data.documents import DocumentRule, packed_sequences
from megalite.model.document_attention import AttentionInputs, document_attention
from megalite.model.families import causal_lm
from megalite.model.init import init_parameters
from tests.unit.model.test_document_mask import (
    EOS,
    FAMILIES,
    grads,
    packed_windows,
    token_losses,
)

# two windows of 12 tokens: documents of 5, 4, 3 and of 1, 11 tokens (ids as the loader makes)
IDS = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] + [1] * 11])


def causal_pieces(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """varlen_attn on CPU: each piece of the packed [tokens, heads, d] alone, causal."""
    inspect.signature(varlen.varlen_attn).bind(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    assert kwargs["window_size"] == (-1, 0) and torch.equal(cu_q, cu_k)
    assert cu_q.dtype == torch.int32 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        piece = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        out.append(F.scaled_dot_product_attention(*piece, is_causal=True,
                                                  enable_gqa=kwargs["enable_gqa"])[0]
                   .transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_path_equals_the_boolean_mask(monkeypatch, kv_heads):
    g = torch.Generator().manual_seed(0)

    def tensor(heads):
        return torch.randn(2, heads, 12, 8, generator=g, dtype=torch.float64,
                           requires_grad=True)
    q, k, v = tensor(4), tensor(kv_heads), tensor(kv_heads)
    grad = torch.randn(q.shape, generator=g, dtype=torch.float64)
    monkeypatch.setattr(varlen, "varlen_attn", causal_pieces)
    outs = []
    for kernel in ("varlen", "sdpa"):
        inputs = AttentionInputs(ids=IDS, kernel=kernel)
        out = document_attention(q, k, v, inputs, 0.0, "auto")
        outs.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    assert AttentionInputs(ids=IDS).packed_sequences()[0].tolist() == [0, 5, 9, 12, 13, 24]
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_which_kernel_runs():
    """auto: FlexAttention on CUDA without dropout under train.attention=auto, else SDPA;
    a named kernel runs as named (validation refuses it where it cannot)."""
    assert resolved_document_kernel("auto", "cuda", 0.0, "auto") == "flex"
    assert resolved_document_kernel("auto", "cuda", 0.1, "auto") == "sdpa"
    assert resolved_document_kernel("auto", "cuda", 0.0, "math") == "sdpa"
    assert resolved_document_kernel("auto", "cpu", 0.0, "auto") == "sdpa"
    assert resolved_document_kernel("varlen", "cuda", 0.0, "auto") == "varlen"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_model_runs_the_kernel_it_is_given(monkeypatch, arch):
    """CausalLM(document_kernel=varlen) (train.document_kernel, build_stage's argument) runs
    the variable-length path in every block: the packed window's per-token losses and
    gradients equal the boolean mask's (fp32: losses 1e-6, gradients 1e-5 relative)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].tolist())
        return causal_pieces(*args, **kwargs)
    monkeypatch.setattr(varlen, "varlen_attn", counted)
    window = packed_windows()
    x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    documents = DocumentRule(EOS).of(window[:, :-1])
    got = []
    for kernel in ("varlen", "sdpa"):
        model = causal_lm(FAMILIES[arch], document_kernel=kernel)
        init_parameters(model, seed=3)
        losses = token_losses(model, x, y, documents)
        losses.sum().backward()
        got.append((losses.detach(), grads(model)))
    assert len(calls) == FAMILIES[arch].n_layer
    torch.testing.assert_close(got[0][0], got[1][0], rtol=0, atol=1e-6)
    for name, grad in got[1][1].items():
        torch.testing.assert_close(got[0][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_batch_brings_the_pieces_made_on_the_host():
    """DocumentRule.of makes the variable-length kernel's pieces from the ids on the host
    (no wait for the GPU in the forward), as `packed_sequences` makes them from the ids."""
    window = np.array([[5, 6, 0, 7, 0, 0, 8, 9], [0, 1, 2, 3, 4, 5, 6, 0]])
    docs = DocumentRule(0).of(window)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 9, 16] and docs.longest == 7
    cu, longest = packed_sequences(docs.ids)
    assert torch.equal(docs.cu_seqlens, cu) and docs.longest == longest
    inputs = AttentionInputs.of(docs, "varlen")
    assert inputs.packed_sequences() == (docs.cu_seqlens, 7)
    assert DocumentRule(0).of(window, (2, 0)).cu_seqlens is None  # CP: the CP kernels' own
