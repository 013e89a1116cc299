"""Document masking proven in one process: a packed window under train.attention_mask=document
gives every token the loss and every parameter the gradient of running each document alone
(fp32, 1e-6), both families, with and without reset positions; the masked loss of
train.eos_loss=false (per micro-batch, and per counted target over a step's micro-batches
with the loss share; a rank without a counted target gives 0); a CP rank's documents; the
default (causal) path untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalite.config.model import ModelConfig
from megalite.data.documents import (
    DocumentRule,
    Documents,
    counted_targets,
    with_loss_share,
)
from megalite.model.families import causal_lm
from megalite.model.init import init_parameters

EOS = 0
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
FAMILIES = {
    "gpt2": ModelConfig(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=97,
                        **NO_DROPOUT),
    "llama": ModelConfig(arch="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                         n_positions=64, vocab_size=97, n_inner=48,
                         tie_word_embeddings=False, **NO_DROPOUT),
}
# two packed windows of 24 tokens: documents of several lengths (one a lone EOS), each ended by
# EOS; a window's last EOS is only a target (the inputs are the first 23 tokens)
LENGTHS = [[5, 9, 1, 6, 3], [11, 4, 7, 2]]


def packed_windows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = []
    for lengths in LENGTHS:
        row = []
        for n in lengths:
            row += list(rng.integers(1, 97, n - 1)) + [EOS]
        rows.append(row[:24] + list(rng.integers(1, 97, 24 - len(row[:24]))))
    return np.array(rows, dtype=np.int64)


def document_spans(row: np.ndarray):
    """(start, stop) of each document of a window's inputs."""
    ends = [i + 1 for i in np.flatnonzero(row == EOS)] + [len(row)]
    starts = [0] + ends[:-1]
    return [(a, b) for a, b in zip(starts, ends) if b > a]


def token_losses(model, ids, targets, documents=None) -> torch.Tensor:
    logits = model(ids, documents=documents)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="none").view(targets.shape)


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reset_positions", [False, True], ids=["global-pos", "reset-pos"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_window_equals_each_document_alone(arch, reset_positions):
    """Per-token losses and the gradients of their sum: packed and masked == one document at
    a time (at its own positions: restarted, or where it sits in the window)."""
    torch.manual_seed(0)
    model = causal_lm(FAMILIES[arch])
    init_parameters(model, seed=3)
    window = packed_windows()
    x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    rule = DocumentRule(EOS, mask=True, reset_positions=reset_positions)
    packed = token_losses(model, x, y, rule.of(window[:, :-1]))
    packed.sum().backward()
    packed_grads = grads(model)
    model.zero_grad()
    alone = torch.empty_like(packed)
    for row in range(x.shape[0]):
        for a, b in document_spans(window[row, :-1]):
            start = 0 if reset_positions else a
            positions = torch.arange(start, start + b - a)[None]
            losses = token_losses(model, x[row:row + 1, a:b], y[row:row + 1, a:b],
                                  Documents(positions=positions))
            losses.sum().backward()
            alone[row, a:b] = losses[0].detach()
    assert len(document_spans(window[0, :-1])) > 3
    torch.testing.assert_close(packed.detach(), alone, rtol=0, atol=1e-6)
    for name, grad in grads(model).items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_document_mask_changes_the_loss_and_causal_is_the_default(arch):
    """The mask is not a no-op on a packed window, and a batch without documents (or with
    documents that carry nothing) is exactly the causal run."""
    model = causal_lm(FAMILIES[arch])
    init_parameters(model, seed=3)
    window = packed_windows()
    x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    with torch.no_grad():
        causal = model(x, y)
        assert torch.equal(model(x, y, documents=Documents()), causal)
        masked = model(x, y, documents=DocumentRule(EOS).of(window[:, :-1]))
    assert (masked - causal).abs() > 1e-4


def test_eos_loss_false_leaves_out_the_target_after_eos():
    """train.eos_loss=false: the loss is the mean over the targets whose input is not EOS."""
    model = causal_lm(FAMILIES["gpt2"])
    init_parameters(model, seed=3)
    window = packed_windows()
    x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    docs = DocumentRule(EOS, mask=False, eos_loss=False).of(window[:, :-1])
    with torch.no_grad():
        loss = model(x, y, documents=docs)
        per_token = token_losses(model, x, y)
    counted = x != EOS
    assert not counted.all()
    torch.testing.assert_close(loss, per_token[counted].mean(), rtol=1e-6, atol=0)


def test_documents_of_a_window():
    """Ids, restarted positions and counted targets from the EOS tokens (EOS = 0)."""
    docs = DocumentRule(0, reset_positions=True, eos_loss=False).of(
        np.array([[5, 6, 0, 7, 0, 0, 8, 9]]))
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert docs.counted.tolist() == [[True, True, False, True, False, False, True, True]]
    assert DocumentRule(0).of(np.array([[3, 4]])).positions is None


def test_documents_of_a_cp_rank_are_its_chunks_of_the_window():
    """cp=2: rank 0 keeps chunks 0 and 3 of 4 (tokens 0-1, 6-7), rank 1 chunks 1 and 2: the
    global ids, the positions in their documents and the counted targets of those tokens, the
    pairs their queries see (the window's Σ n(n+1)/2 = 6 + 3 + 1 + 3 over the ranks), and the
    CP kernels' document spans."""
    window = np.array([[5, 6, 0, 7, 0, 0, 8, 9]])
    rule = DocumentRule(0, reset_positions=True, eos_loss=False)
    ranks = [rule.of(window, (2, r)) for r in range(2)]
    assert [d.ids.tolist() for d in ranks] == [[[0, 0, 3, 3]], [[0, 1, 1, 2]]]
    assert [d.positions.tolist() for d in ranks] == [[[0, 1, 0, 1]], [[2, 0, 1, 0]]]
    assert [d.counted.tolist() for d in ranks] == [[[True, True, True, True]],
                                                   [[False, True, False, False]]]
    assert [d.visible_pairs for d in ranks] == [6, 7]
    assert rule.of(window).visible_pairs == 13
    # the CP kernels' spans, made here on the host: each token's document's first position,
    # the pieces (sequence, local start, end, global start, key start), the chunks' first
    assert [d.spans.first.tolist() for d in ranks] == [[[0, 0, 6, 6]], [[0, 3, 3, 5]]]
    assert [d.spans.pieces for d in ranks] == [
        ((0, 0, 2, 0, 0), (0, 2, 4, 6, 6)),
        ((0, 0, 1, 2, 0), (0, 1, 2, 3, 3), (0, 2, 3, 4, 3), (0, 3, 4, 5, 5))]
    assert ranks[0].spans.chunk_first == ranks[1].spans.chunk_first == (0, 0, 3, 6)
    assert ranks[1].to(torch.device("cpu")).spans.pieces == ranks[1].spans.pieces
    assert rule.of(window).spans is None  # cp 1: the single-rank kernels' inputs


def test_the_loss_share_gives_the_step_mean_per_counted_target():
    """Micro-batches with unequal counted targets: the mean of their losses under the step's
    loss share is the mean over all counted targets (not the mean of per-batch means)."""
    model = causal_lm(FAMILIES["gpt2"])
    init_parameters(model, seed=3)
    window = packed_windows()
    rule = DocumentRule(EOS, mask=False, eos_loss=False)
    batches = [(torch.from_numpy(w[None, :-1]), torch.from_numpy(w[None, 1:]),
                rule.of(w[None, :-1])) for w in window]
    shared = with_loss_share(batches, counted_targets(batches), ranks=1)
    with torch.no_grad():
        step = sum(model(x, y, documents=d) for x, y, d in shared) / len(shared)
        per_token = token_losses(model, *[torch.from_numpy(p) for p in (window[:, :-1],
                                                                        window[:, 1:])])
    counted = torch.from_numpy(window[:, :-1] != EOS)
    assert counted[0].sum() != counted[1].sum()
    torch.testing.assert_close(step, per_token[counted].mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("share", [None, 7.5], ids=["own-count", "step-share"])
def test_a_rank_without_a_counted_target_gives_a_zero_loss(share):
    """All targets left out (a CP rank whose chunks are EOS only): loss 0, gradients 0."""
    model = causal_lm(FAMILIES["llama"])
    init_parameters(model, seed=3)
    window = packed_windows()
    x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    loss = model(x, y, documents=Documents(counted=torch.zeros_like(x, dtype=torch.bool),
                                           loss_share=share))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
