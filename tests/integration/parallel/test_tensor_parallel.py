"""Tensor and sequence parallelism on real gloo ranks: each layer against its plain PyTorch
reference (outputs and every gradient), GPT-2 logits against transformers on the same weights,
training equal to tp=1, and the RNG regions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.config.schema import ModelConfig
from megalite.parallel.param_spec import ParamSpec, padded_vocab_size
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from tests.conftest import random_hf_gpt2, serial_common
from tests.layouts import assert_equal, close, train_layouts

S, B, H = 8, 3, 12  # sequence, batch, hidden of the layer tests


def _seq_shard(x, rank, tp, sp):
    return x.chunk(tp, dim=0)[rank] if sp else x


def _layers(rank, world):
    return {sp: _layer_errors(rank, world, sp) for sp in (False, True)}


def _layer_errors(rank, world, sp):
    """Every layer's outputs and gradients against the reference's, on this rank's slice."""
    g = build_topology(world, 1, 1).tp_group
    torch.manual_seed(0)  # the same global tensors on every rank (the parts draw in turn)
    errors = {}
    for part in (_mlp_errors, _qkv_errors, _embedding_errors, _cross_entropy_errors):
        errors.update(part(rank, world, sp, g))
    return errors


def _err(ours, ref) -> float:
    """Max error relative to the reference's largest entry."""
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _mlp_errors(rank, tp, sp, g):
    """Column -> Row: the MLP pattern, y = Row(gelu(Column(x)))."""
    from megalite.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    w1, b1 = torch.randn(4 * H, H), torch.randn(4 * H)
    w2, b2 = torch.randn(H, 4 * H), torch.randn(H)
    x = torch.randn(S, B, H)
    gy = torch.randn(S, B, H)
    x_ref = x.clone().requires_grad_()
    ref_params = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
    y_ref = F.linear(F.gelu(F.linear(x_ref, ref_params[0], ref_params[1])), ref_params[2], ref_params[3])
    (y_ref * gy).sum().backward()

    col = ColumnParallelLinear(H, 4 * H, g, sp)
    row = RowParallelLinear(4 * H, H, g, sp)
    col_spec = ParamSpec("w1", (4 * H, H), tp_dim=0)
    row_spec = ParamSpec("w2", (H, 4 * H), tp_dim=1)
    with torch.no_grad():
        col.weight.copy_(col_spec.shard(w1, rank, tp))
        col.bias.copy_(ParamSpec("b1", (4 * H,), tp_dim=0).shard(b1, rank, tp))
        row.weight.copy_(row_spec.shard(w2, rank, tp))
        row.bias.copy_(b2)
    x_in = _seq_shard(x, rank, tp, sp).clone().requires_grad_()
    y = row(F.gelu(col(x_in)))
    (y * _seq_shard(gy, rank, tp, sp)).sum().backward()
    # the row bias is TP-replicated: with SP each rank has the part of its sequence chunk,
    # summed over TP by the engine; without SP each rank has all of it
    db = row.bias.grad.clone()
    if sp:
        torch.distributed.all_reduce(db, group=g.pg)
    return {"mlp out": _err(y, _seq_shard(y_ref, rank, tp, sp)),
            "mlp dx": _err(x_in.grad, _seq_shard(x_ref.grad, rank, tp, sp)),
            "col dw": _err(col.weight.grad, col_spec.shard(ref_params[0].grad, rank, tp)),
            "col db": _err(col.bias.grad, ref_params[1].grad.chunk(tp)[rank]),
            "row dw": _err(row.weight.grad, row_spec.shard(ref_params[2].grad, rank, tp)),
            "row db": _err(db, ref_params[3].grad)}


def _qkv_errors(rank, tp, sp, g):
    """Fused QKV: column-parallel with the [q|k|v] interleave keeps whole heads per rank."""
    w = torch.randn(3 * H, H)
    qkv_spec = ParamSpec("c_attn", (3 * H, H), tp_dim=0, tp_interleave=3)
    local = qkv_spec.shard(w, rank, tp)
    q, k, v = w.chunk(3)
    expect = torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
    return {"qkv shard": _err(local, expect),
            "qkv unshard": _err(qkv_spec.unshard([qkv_spec.shard(w, r, tp)
                                                  for r in range(tp)]), w)}


def _embedding_errors(rank, tp, sp, g):
    """Vocab-parallel embedding with a vocabulary padded to 128·tp."""
    from megalite.parallel.tensor import VocabParallelEmbedding

    vocab = 211
    padded = padded_vocab_size(vocab, tp)
    table = torch.randn(vocab, H)
    ids = torch.randint(0, vocab, (S, B))
    emb_spec = ParamSpec("wte", (vocab, H), tp_dim=0, padded_rows=padded)
    emb = VocabParallelEmbedding(padded, H, g, sp)
    with torch.no_grad():
        emb.weight.copy_(emb_spec.shard(table, rank, tp))
    t_ref = table.clone().requires_grad_()
    e_ref = F.embedding(ids, t_ref)
    ge = torch.randn(S, B, H)
    (e_ref * ge).sum().backward()
    e = emb(ids)
    (e * _seq_shard(ge, rank, tp, sp)).sum().backward()
    return {"emb out": _err(e, _seq_shard(e_ref, rank, tp, sp)),
            "emb dw": _err(emb.weight.grad, emb_spec.shard(t_ref.grad, rank, tp))}


def _cross_entropy_errors(rank, tp, sp, g):
    """Vocab-parallel cross-entropy: logits stay split, padded columns never count; in
    chunks of 5 tokens (the last one short); vocabulary 130 padded to 128·tp: at tp = 4
    ranks 2 and 3 hold only padding."""
    from megalite.parallel.cross_entropy import cross_entropy

    errors = {}
    for vocab in (211, 130):
        padded = padded_vocab_size(vocab, tp)
        logits = torch.randn(S * B, padded)
        target = torch.randint(0, vocab, (S * B,))
        gl = torch.rand(S * B)
        l_ref = logits[:, :vocab].clone().requires_grad_()
        loss_ref = F.cross_entropy(l_ref, target, reduction="none")
        (loss_ref * gl).sum().backward()
        cols = padded // tp
        l_local = logits[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()
        loss = cross_entropy(l_local, target, g, rank * cols, vocab, rows=5)
        (loss * gl).sum().backward()
        errors[f"ce loss {vocab}"] = _err(loss, loss_ref)
        grad_full = torch.cat([l_ref.grad, torch.zeros(S * B, padded - vocab)], dim=1)
        errors[f"ce dlogits {vocab}"] = _err(l_local.grad,
                                             grad_full[:, rank * cols:(rank + 1) * cols])
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_layers_equal_their_serial_reference(tp):
    """With and without sequence parallelism; errors relative to the reference's magnitude."""
    for rank, by_sp in enumerate(run_ranks(_layers, tp)):
        for sp, errors in by_sp.items():
            for name, e in errors.items():
                assert e <= 1e-5, (rank, sp, name, e)


def _logits_vs_hf(rank, world, cfg, sp, state, ids, ref_logits, ref_loss):
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import load_global_state

    topo = build_topology(world, 1, 1)
    ours = GPT2(cfg, topo.tp_group, sequence_parallel=sp).eval()
    load_global_state(ours, state)
    with torch.no_grad():
        logits = ours(ids[:, :16])  # with SP the length must divide by tp
        loss = ours(ids[:, :-1], ids[:, 1:])
    return (logits - ref_logits).abs().max().item(), abs(loss.item() - ref_loss)


@pytest.mark.distributed
@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_gpt2_logits_equal_transformers_with_the_gpt2_vocabulary(tp, sp):
    """vocab 50257 is not divisible by tp: padded to 50432 / 50688, padding never shows."""
    from megalite.model.gpt2.hf import from_hf_state_dict

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=50257,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = random_hf_gpt2(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = hf(ids[:, :16]).logits
        ref_loss = hf(ids, labels=ids).loss.item()  # HF shifts the labels itself
    state = from_hf_state_dict(hf.state_dict())
    for logit_err, loss_err in run_ranks(_logits_vs_hf, tp, args=(cfg, sp, state, ids,
                                                                  ref_logits, ref_loss)):
        assert logit_err <= 1e-4 and loss_err <= 1e-5, (logit_err, loss_err)


@pytest.fixture(scope="module")
def serial_run(serial_reference, tiny_data):
    assert serial_common(tiny_data) == _common(tiny_data)  # the run it is the reference of
    return serial_reference


def _common(tiny_data):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8"]


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_training_equals_tp1(tiny_data, tmp_path, serial_run, tp):
    """10 optimizer steps (fp32, dropout 0), sequence parallelism off and on, and on with the
    first of the two blocks recomputed: losses, grad norms, validation loss and every parameter
    slice after every step equal the tp=1 run within 1e-5 relative."""
    runs = [_common(tiny_data) + [f"tp={tp}", f"sp={sp}"] for sp in ("false", "true")]
    runs.append(runs[-1] + ["train.recompute=true", "train.recompute_layers=1"])
    for ranks in train_layouts(tmp_path, tp, runs):
        assert_equal(serial_run, ranks)


def _rng_regions(rank, world):
    """Masks drawn inside the TP region differ across TP ranks, outside they agree; a
    replicated activation after dropout stays identical on every TP rank."""
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite.parallel.rng import RNGTracker

    topo = build_topology(world, 1, 1)
    tracker = RNGTracker(seed=7, tp_rank=rank, pp_rank=0, dp_rank=0, device=torch.device("cpu"))
    outside = torch.rand(64)
    with tracker.tp_region():
        inside = torch.rand(64)
    again = torch.rand(64)
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=128,
                      resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    model = GPT2(cfg, topo.tp_group, sequence_parallel=False, rng=tracker).train()
    init_parameters(model, seed=1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    hidden = model.transformer.h["0"](model.embed(ids))
    return outside, inside, again, hidden.detach()


@pytest.mark.distributed
def test_dropout_masks_differ_inside_and_agree_outside_tp_regions():
    (o0, i0, a0, h0), (o1, i1, a1, h1) = run_ranks(_rng_regions, 2)
    assert torch.equal(o0, o1) and torch.equal(a0, a1)
    assert not torch.equal(i0, i1)
    assert not torch.equal(o0, a0)  # the replicated stream advanced past the TP region
    assert torch.equal(h0, h1)  # replicated residual stream: same masks, same values


@pytest.mark.distributed
def test_dropout_run_is_reproducible_from_its_seed(tiny_data, tmp_path):
    """Same seed, same losses; another seed, other losses. With activation recomputation the
    re-run forward in backward draws the same masks as the first (replicated and TP streams
    restored), so gradients and the following steps equal the run without it — also when only
    the first block is recomputed."""
    dropout = ["model.resid_pdrop=0.1", "model.attn_pdrop=0.1", "model.embd_pdrop=0.1",
               "tp=2", "sp=true"]
    runs = train_layouts(tmp_path, 2, [_common(tiny_data) + dropout + extra for extra in (
        ["seed=5"], ["seed=5"], ["seed=6"], ["seed=5", "train.recompute=true"],
        ["seed=5", "train.recompute=true", "train.recompute_layers=1"])], steps=3)
    assert runs[0][0]["losses"] == runs[1][0]["losses"]
    assert runs[0][0]["losses"] != runs[2][0]["losses"]
    for plain, recomputed in [pair for run in runs[3:] for pair in zip(runs[0], run)]:
        for key in ("losses", "norms"):
            assert all(close(a, b, 1e-6) for a, b in zip(plain[key], recomputed[key])), \
                (key, plain[key], recomputed[key])


def _activation_bytes(rank, world):
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite_bench.tensor import formulas, saved_activation_bytes

    cfg = ModelConfig(n_layer=1, n_embd=64, n_head=4, n_positions=32, vocab_size=256,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    topo = build_topology(world, 1, 1)
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for sp in (False, True):
        model = GPT2(cfg, topo.tp_group, sequence_parallel=sp).train()
        init_parameters(model, seed=0)
        x = model.embed(ids).detach().requires_grad_()
        measured = saved_activation_bytes(lambda: model.transformer.h["0"](x), model.parameters())
        out[sp] = (measured, formulas(32, 3, 64, 4, world, sp and world > 1, 4)["ours"])
    return out


@pytest.mark.distributed
def test_activation_memory_per_layer_matches_the_formula():
    """What autograd keeps per layer: e·sbh(4 + 12/t) with TP, e·sbh·16/t with TP + SP (plus
    LayerNorm statistics and the attention log-sum-exp); megalite_bench/tensor.py derives it."""
    for rank, by_sp in enumerate(run_ranks(_activation_bytes, 2)):
        for sp, (measured, formula) in by_sp.items():
            assert measured == pytest.approx(formula, rel=1e-9), (rank, sp, measured, formula)
    ((alone, formula),) = [v for k, v in run_ranks(_activation_bytes, 1)[0].items() if not k]
    assert alone == pytest.approx(formula, rel=1e-9)


def _regions(rank, world):
    """Each autograd region's forward and backward against its definition."""
    from megalite.parallel import regions

    g = build_topology(world, 1, 1).tp_group
    torch.manual_seed(0)
    full = torch.randn(4 * world, 3)  # [s, h]; the same on every rank
    grads = torch.randn(world, 4 * world, 3)  # a different upstream gradient per rank
    mine = full.chunk(world)[rank]
    out = {}

    def run(name, fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x, g)
        y.backward(grad.clone())  # backward may reduce the incoming gradient in place
        out[name] = (y.detach(), x.grad)

    run("copy_to_tp", regions.copy_to_tp, full, grads[rank])
    run("reduce_from_tp", regions.reduce_from_tp, full * (rank + 1), grads[0])
    run("scatter_to_seq", regions.scatter_to_seq, full, grads[rank].chunk(world)[rank])
    run("gather_from_seq", regions.gather_from_seq, mine, grads[rank])
    run("reduce_scatter_to_seq", regions.reduce_scatter_to_seq, full * (rank + 1),
        grads[0].chunk(world)[rank])
    return out, full, grads


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_the_five_regions_forward_and_backward(world):
    """copy_to_tp: identity / all-reduce; reduce_from_tp: all-reduce / identity;
    scatter_to_seq: split / all-gather; gather_from_seq: all-gather / reduce-scatter;
    reduce_scatter_to_seq: reduce-scatter / all-gather (sequence = dim 0)."""
    results = run_ranks(_regions, world)
    _, full, grads = results[0]
    total = sum(range(1, world + 1))
    for rank, (out, _, _) in enumerate(results):
        def chunk(t):
            return t.chunk(world)[rank]
        y, dx = out["copy_to_tp"]
        assert torch.equal(y, full) and torch.allclose(dx, grads.sum(0))
        y, dx = out["reduce_from_tp"]
        assert torch.allclose(y, full * total) and torch.equal(dx, grads[0])
        y, dx = out["scatter_to_seq"]
        assert torch.equal(y, chunk(full))
        assert torch.equal(dx, torch.cat([grads[r].chunk(world)[r] for r in range(world)]))
        y, dx = out["gather_from_seq"]
        assert torch.equal(y, full) and torch.allclose(dx, chunk(grads.sum(0)))
        y, dx = out["reduce_scatter_to_seq"]
        assert torch.allclose(y, chunk(full * total))
        assert torch.equal(dx, grads[0])
