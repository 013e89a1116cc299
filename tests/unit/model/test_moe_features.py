"""MoE with the training features, in one process: activation recomputation and activation
offload leave the gradients bitwise equal and count the routing once (the re-run computes the
penalty's terms again and records nothing), and FP8 tensorwise on the experts quantizes each
expert's weight and rows with their own scales (against a hand-quantized reference), leaving
the router in fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.model.activation_offload import ActivationOffload
from megalite.model.families import causal_lm
from megalite.model.init import init_parameters
from megalite.model.moe.experts import Experts, dispatch
from megalite.parallel.fp8 import E4M3, use_fp8

H, FFN, E = 32, 16, 4


def tiny_mixtral(aux_loss: str) -> ModelConfig:
    moe = MoEConfig(num_experts=E, top_k=2, aux_loss=aux_loss, aux_loss_coeff=0.1,
                    z_loss_coeff=0.01, bias_update_rate=0.0 if aux_loss == "hf" else 0.01)
    return ModelConfig(name="t", arch="mixtral", n_layer=2, n_embd=H, n_head=4, n_kv_head=2,
                       n_positions=64, vocab_size=97, n_inner=FFN, tie_word_embeddings=False,
                       rope_theta=50000.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       moe=moe)


def _train_forwards(cfg: ModelConfig, forwards: int = 2, **stage):
    """Two training forwards and backwards (the gradients accumulate): the gradients and the
    ledger's figures."""
    model = causal_lm(cfg, **stage)
    init_parameters(model, seed=3)
    model.train()
    for seed in range(forwards):
        ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(seed))
        model(ids[:, :-1], ids[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters()}, model.routing.figures


@pytest.mark.parametrize("aux_loss", ["layer", "sequence", "hf"])
def test_recompute_and_activation_offload_leave_gradients_and_figures_bitwise_equal(aux_loss):
    """Every block recomputed, the first one only, and every block's activations offloaded:
    the gradients of the loss with the aux loss and z-loss equal the plain run's bitwise, the
    counts, aux, z-loss and forwards are those of the forwards alone (before the fix the
    re-run ran fewer operations than the forward and torch's checkpoint refused it)."""
    cfg = tiny_mixtral(aux_loss)
    grads, figures = _train_forwards(cfg)
    for stage in ({"recompute": True}, {"recompute": True, "recompute_layers": 1},
                  {"offload": ActivationOffload("cpu")},
                  {"recompute": True, "recompute_layers": 1, "offload": ActivationOffload("cpu")}):
        ours, theirs = _train_forwards(cfg, **stage)
        for name, grad in grads.items():
            assert torch.equal(ours[name], grad), (stage, name)
        for key in ("counts", "aux", "z", "dropped", "assigned", "pooled"):
            assert torch.equal(getattr(theirs, key), getattr(figures, key)), (stage, key)
        assert theirs.forwards == figures.forwards == 2


def _experts(seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    experts = Experts(MoEConfig(num_experts=E, top_k=2), H, FFN)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """t through e4m3 with its own tensorwise scale, back in fp32."""
    scale = torch.finfo(E4M3).max / t.abs().amax().float()
    return (t.float() * scale).to(E4M3).float() / scale


def _per_expert_reference(experts: Experts, x, weights, d) -> torch.Tensor:
    """Each expert's rows and weights quantized alone, the products in fp32."""
    k = weights.shape[1]
    tokens = torch.div(d.order, k, rounding_mode="floor")
    out = torch.zeros_like(x)
    counts = d.counts.tolist()
    for e, (rows, chosen) in enumerate(zip(tokens.split(counts), d.order.split(counts))):
        if rows.numel() == 0:
            continue
        h = _quantized(x[rows]) @ _quantized(experts.gate_up_proj[e]).t()
        gate, up = h.chunk(2, dim=-1)
        y = _quantized(F.silu(gate) * up) @ _quantized(experts.down_proj[e]).t()
        out.index_add_(0, rows, y * weights.reshape(-1)[chosen, None])
    return out


def test_fp8_experts_quantize_each_expert_alone_and_the_router_stays_fp32():
    """fp8.recipe=tensorwise on the experts: the output equals the per-expert hand-quantized
    reference; it differs from the fp32 experts' by FP8's order (e4m3: 3 mantissa bits); the
    gradients are finite, FP8's order off the fp32 ones, and zero for an expert without
    tokens; use_fp8 switches the experts and leaves the router's linear alone."""
    x = torch.randn(24, H)
    indices = torch.randint(0, E - 1, (24, 2))  # the last expert gets nothing
    weights = torch.rand(24, 2)
    d = dispatch(indices, weights, E, None)
    grad = torch.randn(24, H)
    runs = {}
    for recipe in ("none", "tensorwise"):
        experts = _experts()
        experts.fp8 = None if recipe == "none" else recipe
        xi = x.clone().requires_grad_()
        y = experts(xi, weights, d)
        y.backward(grad)
        runs[recipe] = (experts, y.detach(), xi.grad, experts.gate_up_proj.grad,
                        experts.down_proj.grad)
    fp8, plain = runs["tensorwise"], runs["none"]
    with torch.no_grad():
        expected = _per_expert_reference(fp8[0], x, weights, d)
    assert (fp8[1] - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    for ours, theirs in zip(fp8[1:], plain[1:]):
        rel = ((ours - theirs).norm() / theirs.norm()).item()
        assert 1e-3 < rel < 0.15, rel
    for g in fp8[3:]:
        assert torch.isfinite(g).all() and g[E - 1].abs().max() == 0 and g[0].abs().max() > 0


def test_use_fp8_switches_the_experts_not_the_router():
    model = causal_lm(tiny_mixtral("layer"))
    use_fp8(model, "tensorwise")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == 2 and all(m.fp8 == "tensorwise" for m in experts)
    assert not any(hasattr(m.gate, "fp8") for m in model.modules() if hasattr(m, "gate"))


def test_fp8_with_moe_refuses_by_key_and_counts_the_experts():
    """An expert size FP8 cannot take (not a multiple of 16, one TP rank's share under tp > 1)
    is refused by fp8.recipe naming the experts; tp2 + SP and cp2 are taken; the time model's
    FP8 weights a token passes are o_proj's and the top_k experts' (a dense block: its MLP)."""
    from megalite.config.errors import ConfigError
    from megalite.config.layout import validate
    from megalite.config.schema import load_config
    from megalite.model.families import family

    fp8 = ["model=mixtral-tiny", "device=cpu", "fp8.recipe=tensorwise", "fp8.emulate=true"]
    cases = [(["model.moe.expert_size=24"], 1, "fp8.recipe", "mlp.experts.down_proj"),
             (["tp=2", "sp=true", "model.moe.expert_size=48"], 2, "fp8.recipe",
              "model.moe.expert_size / tp = 24")]
    for extra, world, key, says in cases:
        with pytest.raises(ConfigError) as e:
            validate(load_config(fp8 + extra), world)
        assert e.value.key == key and says in str(e.value), str(e.value)
    for extra in (["tp=2", "sp=true"], ["cp=2"]):
        validate(load_config(fp8 + extra), 2)
    m = load_config(fp8).model
    h, i, a = m.n_embd, m.moe.expert_hidden(m.ffn_size), m.n_head * m.head_size
    assert family(m).fp8_linear_parameters(m) == a * h + m.moe.top_k * 3 * h * i
    m.moe.first_dense_layers = 1  # 1 dense block of 4: its MLP, 3 MoE blocks' experts
    assert family(m).fp8_linear_parameters(m) == a * h + (
        3 * m.moe.top_k * 3 * h * i + 3 * h * m.ffn_size) // m.n_layer
