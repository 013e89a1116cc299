"""The Mixtral family in one process against a `transformers.MixtralForCausalLM` built in the
test (fp32, eager experts): logits, router logits and expert choices, the training gradient
with transformers' aux loss (aux_loss=hf) and its value, both weight layouts read, the export
loaded back bitwise with equal logits and greedy text, init_from's checks, the counts."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.config.schema import load_config
from megalite.model.families import causal_lm, family, flops_per_token, num_parameters
from megalite.model.hf_io import check_init_from, load_hf_state_dict, save_hf
from megalite.model.init import init_parameters, load_global_state
from megalite.model.mixtral.hf import from_hf_state_dict, hf_config
from tests.hf_export import assert_logits_and_greedy_text_equal, export_initialized
from tests.moe_layers import router_outputs

CFG = ModelConfig(name="mixtral-test", arch="mixtral", n_layer=2, n_embd=64, n_head=4,
                  n_kv_head=2, n_positions=64, vocab_size=211, n_inner=32,
                  tie_word_embeddings=False, rope_theta=50000.0, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0,
                  moe=MoEConfig(num_experts=4, top_k=2, aux_loss="hf", aux_loss_coeff=0.05))


def random_hf_mixtral(cfg: ModelConfig, seed: int = 0):
    """A MixtralForCausalLM of `cfg` (eager experts) with every parameter random."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM._from_config(hf_config(cfg), experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def ours_of(hf, cfg: ModelConfig = CFG):
    model = causal_lm(cfg)
    load_global_state(model, from_hf_state_dict(hf.state_dict()))
    return model


def _ids(shape, seed=1):
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_router_logits_and_choices_equal_transformers():
    hf = random_hf_mixtral(CFG)
    ours = ours_of(hf).eval()
    ids = _ids((2, 24))
    seen = router_outputs(ours)
    with torch.no_grad():
        theirs = hf(ids, output_router_logits=True)
        assert (ours(ids) - theirs.logits).abs().max().item() <= 1e-5
    assert len(seen) == len(theirs.router_logits) == CFG.n_layer
    for routing, their_logits in zip(seen, theirs.router_logits):
        # ours are [s, b] position-major, transformers' [b, s] batch-major
        ours_logits = routing.logits.view(24, 2, -1).transpose(0, 1).reshape(48, -1)
        assert (ours_logits - their_logits).abs().max().item() <= 1e-6
        their_choice = their_logits.softmax(-1).topk(CFG.moe.top_k).indices
        ours_choice = routing.indices.view(24, 2, -1).transpose(0, 1).reshape(48, -1)
        assert torch.equal(ours_choice.sort(-1).values, their_choice.sort(-1).values)


def test_training_gradient_and_aux_value_equal_transformers():
    """Train mode: our loss is the cross-entropy alone (its value), its gradient that of CE +
    coeff · transformers' aux_loss (all layers pooled); the ledger's pooled value equals
    transformers' aux_loss."""
    hf = random_hf_mixtral(CFG).train()
    ours = ours_of(hf).train()
    ids = _ids((2, 25))
    out = hf(ids[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))
    (ce + CFG.moe.aux_loss_coeff * out.aux_loss).backward()
    loss = ours(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert abs(loss.item() - ce.item()) <= 1e-5
    assert abs(ours.routing.figures.pooled.item() - out.aux_loss.item()) <= 1e-5
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g = theirs[name].grad
        assert (p.grad[:g.shape[0]] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_aux_loss_moves_the_gradient():
    """The penalty is in the gradient: without it the router's gradient differs."""
    hf = random_hf_mixtral(CFG)
    grads = []
    for coeff in (0.05, 0.0):
        cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(
            **{**CFG.moe.__dict__, "aux_loss_coeff": coeff})})
        ours = ours_of(hf, cfg).train()
        ids = _ids((2, 17))
        ours(ids[:, :-1], ids[:, 1:]).backward()
        grads.append(ours.model.layers["0"].mlp.gate.weight.grad)
    assert (grads[0] - grads[1]).abs().max().item() > 1e-6


def per_expert_layout(sd):
    """transformers 4's / the hub's per-expert names of a fused MixtralForCausalLM state."""
    out = {}
    for name, t in sd.items():
        m = re.match(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
            continue
        for e, w in enumerate(t):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.block_sparse_moe.experts.{e}.w2.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{m.group(1)}.block_sparse_moe.experts.{e}.w1.weight"] = gate
                out[f"{m.group(1)}.block_sparse_moe.experts.{e}.w3.weight"] = up
    return out


def test_both_layouts_read_alike():
    sd = random_hf_mixtral(CFG).state_dict()
    fused, split = from_hf_state_dict(sd), from_hf_state_dict(per_expert_layout(sd))
    assert fused.keys() == split.keys()
    assert all(torch.equal(fused[k], split[k]) for k in fused)


def test_export_round_trip_bitwise_logits_and_greedy_text(tmp_path):
    from transformers import MixtralForCausalLM

    ours, state = export_initialized(CFG, tmp_path / "hf")
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager")
    hf = hf.eval()
    assert hf.num_parameters() == num_parameters(CFG)
    back = load_hf_state_dict(str(tmp_path / "hf"), CFG)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    ids = _ids((2, 20), seed=2)
    assert_logits_and_greedy_text_equal(ours, hf, ids)


def test_init_from_checks_the_config(tmp_path):
    hf = random_hf_mixtral(CFG)
    hf.save_pretrained(tmp_path / "m")
    check_init_from(str(tmp_path / "m"), CFG)
    wrong = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(
        **{**CFG.moe.__dict__, "num_experts": 8})})
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=8.*num_local_experts=4"):
        check_init_from(str(tmp_path / "m"), wrong)
    sigmoid = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(
        **{**CFG.moe.__dict__, "score": "sigmoid"})})
    with pytest.raises(ConfigError, match=r"model.moe.score='sigmoid'"):
        check_init_from(str(tmp_path / "m"), sigmoid)
    loaded = load_hf_state_dict(str(tmp_path / "m"), CFG)
    assert all(torch.equal(loaded[k], v) for k, v in from_hf_state_dict(hf.state_dict()).items())


@pytest.mark.parametrize("preset, total, active", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("mixtral-8x22b", 140_630_071_296, 39_161_468_928)])
def test_presets_count_total_and_active_parameters(preset, total, active):
    """Mixtral's published sizes (46.7B / 12.9B active, 141B / 39B); FLOPs count the active
    ones: 6·(active − embedding lookup) + 12·L·h·s."""
    m = load_config([f"model={preset}"]).model
    assert (num_parameters(m), family(m).active_parameters(m)) == (total, active)
    lookup = m.vocab_size * m.n_embd
    assert flops_per_token(m, 4096) == 6 * (active - lookup) + 12 * m.n_layer * m.n_embd * 4096


def test_tiny_preset_matches_transformers_count():
    from transformers import MixtralForCausalLM

    m = load_config(["model=mixtral-tiny"]).model
    with torch.device("meta"):
        hf = MixtralForCausalLM(hf_config(m))
    assert hf.num_parameters() == num_parameters(m)


def test_export_refuses_what_mixtral_cannot_hold(tmp_path):
    """A selection bias (aux-loss-free balancing) would be dropped by MixtralForCausalLM:
    refused by key, nothing written."""
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(
        **{**CFG.moe.__dict__, "bias_update_rate": 1e-3})})
    ours = causal_lm(cfg)
    init_parameters(ours, seed=3)
    state = {ours.param_specs[n].name: p.detach() for n, p in ours.named_parameters()}
    with pytest.raises(ConfigError, match=r"^model.moe.bias_update_rate=0.001: "):
        save_hf(state, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("aux_loss", ["layer", "sequence"])
def test_layer_and_sequence_aux_and_z_loss_reach_the_gradient(aux_loss):
    """The training gradient is that of CE + Σ_layers (coeff · aux + z_coeff · z-loss),
    computed here from the routers' outputs of a model without the penalty."""
    from megalite.model.moe import balance

    def cfg_of(aux, z):
        return ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(
            **{**CFG.moe.__dict__, "aux_loss": aux_loss, "aux_loss_coeff": aux,
               "z_loss_coeff": z})})

    hf = random_hf_mixtral(CFG)
    ids = _ids((3, 17))
    ours = ours_of(hf, cfg_of(0.3, 0.05)).train()
    ours(ids[:, :-1], ids[:, 1:]).backward()
    plain = ours_of(hf, cfg_of(0.0, 0.0)).train()
    seen = router_outputs(plain)
    loss = plain(ids[:, :-1], ids[:, 1:])
    for r in seen:
        routed = torch.bincount(r.indices.reshape(-1), minlength=CFG.moe.num_experts)
        aux = balance.layer_aux(r.scores, routed, CFG.moe.top_k) if aux_loss == "layer" \
            else balance.sequence_aux(r.scores, balance.sequence_counts(
                r.indices, 3, CFG.moe.num_experts), CFG.moe.top_k, 16)
        loss = loss + 0.3 * aux + 0.05 * balance.z_loss(r.logits)
    loss.backward()
    expected = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - expected[name].grad).abs().max().item() <= 1e-6, name
    gate = "model.layers.0.mlp.gate.weight"
    ours_plain = ours_of(hf, cfg_of(0.0, 0.0)).train()
    ours_plain(ids[:, :-1], ids[:, 1:]).backward()
    assert (dict(ours_plain.named_parameters())[gate].grad
            - dict(ours.named_parameters())[gate].grad).abs().max() > 1e-5


@pytest.mark.slow
def test_init_from_a_mixtral_directory_gives_transformers_validation_loss(tiny_data, tmp_path):
    """A trainer started from a MixtralForCausalLM directory (init_from): its validation loss
    equals transformers' cross-entropy on the same windows within 1e-5."""
    from megalite.config.layout import validate
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime
    from tests.layouts import composed

    shape = ModelConfig(**{**CFG.__dict__, "vocab_size": 1024, "n_positions": 64})
    hf = random_hf_mixtral(shape)
    hf.save_pretrained(tmp_path / "mixtral")
    cfg = composed([f"data.dir={tiny_data}", "model.arch=mixtral", "model.n_kv_head=2",
                    "model.n_inner=32", "model.rope_theta=50000", "model.tie_word_embeddings=false",
                    "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss=hf",
                    "model.moe.aux_loss_coeff=0.05", f"init_from={tmp_path / 'mixtral'}"])
    validate(cfg, 1)
    trainer = build_trainer(cfg, init_runtime(cfg), tmp_path / "run")
    ours = trainer.evaluate()
    with torch.no_grad():
        losses = [F.cross_entropy(hf(batch[0]).logits.reshape(-1, 1024), batch[1].reshape(-1))
                  for batch in trainer.val_batches()]
    assert abs(ours - sum(losses).item() / len(losses)) <= 1e-5
