"""The shared MoE layer alone (`megalite.model.moe`): the sigmoid / group-limited router with
its bias against transformers' DeepSeek-V3 router, the layer against a dense reference (every
expert on every token, weighted by the routing), top-k = 1 and = E, all tokens on one expert,
an expert without tokens (zero gradient, not NaN), the grouped GEMM against the loop, the
capacity's drops and their count, shared experts with Qwen2-MoE's gate, the balancing losses'
formulas, the bias update, and the refusals of `model.moe` before launch."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.moe import MoEConfig
from megalite.config.schema import load_config
from megalite.model.moe import balance
from megalite.model.moe.experts import Experts, capacity, dispatch
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.router import Router, route
from megalite.model.moe.step import update_bias

H, FFN = 16, 8


def layer_of(moe: MoEConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(moe, H, FFN, index=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def dense_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing weight where chosen (0 else)."""
    flat = x.reshape(-1, H)
    routing = layer.gate(flat)
    w = torch.zeros_like(routing.scores).scatter(1, routing.indices, routing.weights)
    out = torch.zeros_like(flat)
    ex = layer.experts
    for e in range(layer.moe.num_experts):
        gate, up = F.linear(flat, ex.gate_up_proj[e]).chunk(2, dim=-1)
        out = out + w[:, e:e + 1] * F.linear(F.silu(gate) * up, ex.down_proj[e])
    if layer.moe.shared_experts:
        shared = layer.shared_experts(flat)
        if layer.moe.shared_expert_gate:
            shared = torch.sigmoid(layer.shared_experts_gate(flat)) * shared
        out = out + shared
    return out.view_as(x)


@pytest.mark.parametrize("moe", [
    MoEConfig(num_experts=4, top_k=1),
    MoEConfig(num_experts=4, top_k=4),
    MoEConfig(num_experts=6, top_k=2, normalize_top_k=False),
    MoEConfig(num_experts=4, top_k=2, shared_experts=2, shared_expert_gate=True),
    MoEConfig(num_experts=8, top_k=3, score="sigmoid", n_groups=4, top_groups=2,
              scaling_factor=2.5)],
    ids=["top1", "topE", "olmoe-unnormalised", "shared-gated", "deepseek-groups"])
def test_layer_equals_dense_reference(moe):
    moe.check()
    layer = layer_of(moe)
    x = torch.randn(5, 3, H)
    assert (layer(x) - dense_reference(layer, x)).abs().max().item() <= 1e-5
    if moe.top_k == moe.num_experts:  # top-k = E: every expert on every token
        assert layer.gate(x.reshape(-1, H)).indices.sort(-1).values.eq(
            torch.arange(moe.num_experts)).all()


def test_sigmoid_group_limited_router_with_bias_equals_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = MoEConfig(num_experts=16, top_k=4, score="sigmoid", n_groups=4, top_groups=2,
                    scaling_factor=2.5, bias_update_rate=1e-3)
    hf_cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(hf_cfg)
    ours = Router(moe, H)
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.normal_(0, 0.3)  # a bias that changes the choices
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, H)
    logits, weights, indices = theirs(x)
    r = ours(x)
    assert torch.equal(r.logits, logits)
    mine, order = r.indices.sort(-1)
    their_sorted, their_order = indices.sort(-1)
    assert torch.equal(mine, their_sorted)
    assert (r.weights.gather(1, order) - weights.gather(1, their_order)).abs().max() <= 1e-6
    unbiased = route(r.logits, moe)  # the bias changed some choices: the test can fail
    assert not torch.equal(unbiased.indices.sort(-1).values, mine)


def test_expert_without_tokens_has_zero_gradient_and_one_expert_takes_all():
    experts = layer_of(MoEConfig(num_experts=4, top_k=1)).experts
    x = torch.randn(10, H)
    indices = torch.zeros(10, 1, dtype=torch.long)  # every token to expert 0
    weights = torch.rand(10, 1)
    d = dispatch(indices, weights, 4, None)
    y = experts(x, weights, d)
    gate, up = F.linear(x, experts.gate_up_proj[0]).chunk(2, dim=-1)
    assert (y - weights * F.linear(F.silu(gate) * up, experts.down_proj[0])).abs().max() <= 1e-6
    y.backward(torch.randn_like(y))
    for p in (experts.gate_up_proj, experts.down_proj):
        assert torch.isfinite(p.grad).all() and p.grad[1:].abs().max() == 0
        assert p.grad[0].abs().max() > 0


def test_grouped_gemm_equals_the_loop():
    """experts_impl=grouped (torch._grouped_mm, here on the CPU) and loop: the same outputs
    and gradients, an expert without tokens included."""
    outs = []
    x = torch.randn(12, H)
    indices = torch.randint(0, 3, (12, 2))  # expert 3 gets nothing
    weights = torch.rand(12, 2)
    grad = torch.randn(12, H)
    for impl in ("grouped", "loop"):
        experts = layer_of(MoEConfig(num_experts=4, top_k=2, experts_impl=impl)).experts
        xi = x.clone().requires_grad_()
        assert experts.grouped(xi) == (impl == "grouped")
        y = experts(xi, weights, dispatch(indices, weights, 4, None))
        y.backward(grad)
        outs.append((y, xi.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= 1e-5
    assert outs[0][2][3].abs().max() == 0


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_the_overflow_and_counts_it(policy):
    moe = MoEConfig(num_experts=4, top_k=1, capacity_factor=1.0, drop_policy=policy)
    cap = capacity(moe, 8)
    assert cap == 2  # ceil(1.0 · 1 · 8 / 4)
    indices = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2]).view(8, 1)
    weights = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.8, 1.0, 1.0, 1.0]).view(8, 1)
    d = dispatch(indices, weights, 4, cap, policy)
    assert d.dropped.item() == 3 and d.counts.tolist() == [2, 1, 2, 0]
    assert d.routed.tolist() == [5, 1, 2, 0]
    kept = sorted(d.order[:2].tolist())
    assert kept == ([1, 4] if policy == "probs" else [0, 1])
    experts = layer_of(moe).experts
    x = torch.randn(8, H)
    y = experts(x, weights, d)
    assert y[[0, 2, 3] if policy == "probs" else [2, 3, 4]].abs().max() == 0  # dropped: 0


def test_balancing_losses_formulas():
    """layer: E·Σ f·P (1 when balanced); sequence: per sequence, averaged; z-loss:
    mean logsumexp²; pooled = transformers' formula."""
    probs = torch.full((8, 4), 0.25)
    routed = torch.tensor([4, 4, 4, 4])  # 8 tokens, k = 2, balanced
    assert balance.layer_aux(probs, routed, 2).item() == pytest.approx(1.0)
    skew = torch.tensor([16, 0, 0, 0])
    onehot = torch.tensor([[1.0, 0, 0, 0]]).repeat(8, 1)
    assert balance.layer_aux(onehot, skew // 2, 1).item() == pytest.approx(4.0)
    idx = torch.tensor([[0], [1], [0], [1]])  # [s=2, b=2]: sequence 0 -> 0, 0; 1 -> 1, 1
    p = F.one_hot(idx[:, 0], 4).float()
    assert balance.sequence_aux(p, balance.sequence_counts(idx, 2, 4), 1, 2).item() == \
        pytest.approx(4.0)
    logits = torch.randn(5, 4)
    assert balance.z_loss(logits).item() == pytest.approx(
        (torch.logsumexp(logits, -1) ** 2).mean().item())
    assert balance.pooled_aux(routed.float() * 2, probs.sum(0) * 2, 16).item() == \
        pytest.approx(2.0)  # k = 2: transformers' balanced value is k


def test_bias_update_follows_the_sign_rule():
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([8.0, 2.0, 5.0, 5.0]), 0.01)  # mean 5
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


@pytest.mark.parametrize("overrides, key", [
    (["model.moe.top_k=9"], "model.moe.top_k"),
    (["model.moe.n_groups=3"], "model.moe.n_groups"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
    (["model.moe.capacity_factor=-1.5"], "model.moe.capacity_factor"),
    (["model.moe.aux_loss_coeff=-0.1"], "model.moe.aux_loss_coeff"),
    (["model.moe.z_loss_coeff=-1"], "model.moe.z_loss_coeff"),
    (["model.moe.score=relu"], "model.moe.score"),
    (["model.moe.top_groups=2"], "model.moe.top_groups"),
    (["model.moe.aux_loss=hf", "model.moe.score=sigmoid"], "model.moe.aux_loss"),
    (["model.moe.aux_loss=hf", "model.moe.bias_update_rate=0.001"], "model.moe.aux_loss"),
    (["model.moe.shared_expert_gate=true"], "model.moe.shared_expert_gate"),
    (["model.moe.shared_expert_size=64"], "model.moe.shared_expert_size"),
    (["model.moe.num_experts=0"], "model.moe.num_experts"),
    (["model=llama-tiny", "model.moe.num_experts=4"], "model.moe.num_experts"),
    (["tp=2"], "sp"), (["tp=2", "sp=true", "model.moe.expert_size=63"], "tp"),
    (["tp=2", "sp=true", "model.moe.shared_experts=1", "model.moe.shared_expert_size=9"], "tp"),
    (["cp=2", "model.moe.capacity_factor=1.25"], "model.moe.capacity_factor"),
    (["pp=2", "model.moe.aux_loss=hf"], "model.moe.aux_loss"),
    (["fp8.recipe=rowwise", "fp8.emulate=true"], "fp8.recipe"),
    (["train.compile=true"], "train.compile")])
def test_bad_moe_settings_are_refused_before_launch_by_key(overrides, key):
    cfg = load_config(["model=mixtral-tiny", "device=cpu", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2 if any(o[:3] in ("tp=", "pp=", "cp=") for o in overrides)
                 else 1)
    assert e.value.key == key and "\n" not in str(e.value), str(e.value)


def test_capacity_rounds_up():
    moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25)
    assert capacity(moe, 100) == math.ceil(1.25 * 2 * 100 / 8)
    assert capacity(MoEConfig(num_experts=8), 100) is None


def test_experts_layer_takes_stacked_weights():
    experts = Experts(MoEConfig(num_experts=3), H, FFN)
    assert experts.gate_up_proj.shape == (3, 2 * FFN, H) and experts.down_proj.shape == (3, H, FFN)


def test_the_ledger_counts_drops_and_the_step_logs_their_fraction():
    """A layer over capacity: the ledger's figures hold the drops, `finish_step` logs their
    fraction of the assignments, the counts the router chose (before the drop)."""
    from megalite.model.moe.ledger import RoutingLedger
    from megalite.model.moe.step import finish_step
    from megalite.parallel.group import single_rank_group

    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5, bias_update_rate=0.1)
    ledger = RoutingLedger(moe, [3])
    layer = layer_of(moe)
    layer.index, layer.ledger = 3, ledger
    x = torch.randn(6, 2, H)
    ledger.open(True)
    layer(x)
    ledger.close()
    d = dispatch(layer.gate(x.reshape(-1, H)).indices, torch.ones(12, 2), 4, capacity(moe, 12))
    counts = ledger.figures.counts[0].clone()
    assert ledger.figures.dropped.item() == d.dropped.item() > 0
    assert counts.sum().item() == 24
    bias = layer.gate.e_score_correction_bias
    figures = finish_step([ledger], [{3: bias}], single_rank_group("dp"), update=True)
    assert figures["3"]["dropped"] == pytest.approx(d.dropped.item() / 24)
    assert figures["3"]["imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert torch.equal(bias, 0.1 * torch.sign(counts.mean() - counts).float())
    assert ledger.figures is None  # cleared for the next step


def test_a_stage_without_the_head_sends_its_penalty_the_objectives_weight():
    """A Mixtral stage without the LM head: its output's value is the blocks' output; its
    backward gives the routers the gradient of output · g + objective_scale · penalty (the
    penalty rebuilt from a forward of a stage with the penalty's graph alone), and refuses to
    run a penalty without a scale."""
    from megalite.model.families import causal_lm
    from megalite.model.init import init_parameters

    cfg = load_config(["model=mixtral-tiny", "device=cpu", "model.n_layer=2",
                       "model.moe.aux_loss_coeff=0.5", "model.moe.z_loss_coeff=0.1"]).model
    stage = causal_lm(cfg, blocks=range(2), first=True, last=False)
    with torch.no_grad():
        init_parameters(stage, seed=0)
    stage.train()
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with pytest.raises(ValueError, match="objective_scale"):
        stage(ids)
    stage.objective_scale = 0.25
    out = stage(ids)
    g = torch.randn_like(out)
    out.backward(g)
    got = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad()
    stage.routing.open(True)
    x = stage.embed(ids)
    for block in stage.block_list():
        x = block(x, None)
    expect = (x * g).sum() + 0.25 * stage.routing.close()
    expect.backward()
    torch.testing.assert_close(out, x)
    for p, grad in zip(stage.parameters(), got):
        torch.testing.assert_close(grad, p.grad)
    routers = [m.gate.weight for m in stage.modules() if isinstance(m, MoELayer)]
    assert len(routers) == 2 and all(w.grad.abs().sum() > 0 for w in routers)


def test_balancing_parts_of_split_tokens_add_up_to_the_whole():
    """A micro-batch's tokens split over ranks (TP under SP, CP): each part, computed with
    the micro-batch's counts and token number, adds up to the value of all the tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g)  # [s=6, b=2] position-major
    probs, idx = logits.softmax(-1), logits.topk(2, dim=-1).indices
    routed, counts = balance.expert_counts(idx, 4), balance.sequence_counts(idx, 2, 4)
    assert torch.equal(counts.sum(0).long(), routed)
    parts = [slice(0, 4), slice(4, 12)]  # 2 and 4 positions of each sequence
    whole = (balance.layer_aux(probs, routed, 2), balance.sequence_aux(probs, counts, 2, 6),
             balance.z_loss(logits))
    split = [(balance.layer_aux(probs[p], routed, 2, 12),
              balance.sequence_aux(probs[p], counts, 2, 6), balance.z_loss(logits[p], 12))
             for p in parts]
    for i, value in enumerate(whole):
        assert (split[0][i] + split[1][i]).item() == pytest.approx(value.item(), rel=1e-6)
