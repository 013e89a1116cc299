"""The Qwen3 and Qwen3-MoE families in one process against `transformers.Qwen3ForCausalLM` /
`Qwen3MoeForCausalLM` built in the test (fp32, eager experts): logits, router logits and expert
choices, the training gradient with transformers' aux loss (aux_loss=hf) and its value, both
expert layouts read, dense blocks placed as mlp_only_layers / decoder_sparse_step place them,
the export loaded back bitwise with equal logits and greedy text, init_from's checks, the
presets' total and active parameters against transformers built on the meta device."""
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
from megalite.model.hf_io import check_init_from, load_hf_state_dict
from megalite.model.init import load_global_state
from megalite.model.qwen3.hf import from_hf_state_dict, hf_config, hf_moe_config
from tests.hf_export import assert_logits_and_greedy_text_equal, export_initialized
from tests.moe_layers import router_outputs

SHAPE = dict(n_layer=3, n_embd=64, n_head=4, n_kv_head=2, head_dim=24, n_positions=64,
             vocab_size=211, n_inner=48, rope_theta=50000.0, layer_norm_epsilon=1e-6,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
DENSE = ModelConfig(name="qwen3-test", arch="qwen3", tie_word_embeddings=True, **SHAPE)
# block 0 dense (mlp_only_layers=[0]), blocks 1, 2 MoE
MOE = ModelConfig(name="qwen3-moe-test", arch="qwen3_moe", tie_word_embeddings=False, **SHAPE,
                  moe=MoEConfig(num_experts=4, top_k=2, expert_size=16, normalize_top_k=False,
                                first_dense_layers=1, aux_loss="hf", aux_loss_coeff=0.05))


def with_moe(cfg: ModelConfig, **moe) -> ModelConfig:
    return ModelConfig(**{**cfg.__dict__, "moe": MoEConfig(**{**cfg.moe.__dict__, **moe})})


def random_hf(cfg: ModelConfig, seed: int = 0):
    """A Qwen3(Moe)ForCausalLM of `cfg` (eager experts) with every parameter random."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if cfg.moe.enabled:
        model = Qwen3MoeForCausalLM._from_config(hf_moe_config(cfg),
                                                 experts_implementation="eager")
    else:
        model = Qwen3ForCausalLM._from_config(hf_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def ours_of(hf, cfg: ModelConfig):
    model = causal_lm(cfg)
    load_global_state(model, from_hf_state_dict(hf.state_dict()))
    return model


def _ids(shape, seed=1):
    return torch.randint(0, SHAPE["vocab_size"], shape,
                         generator=torch.Generator().manual_seed(seed))


# 6 heads of 16 with hidden 64: n_head need not divide n_embd where head_dim is set
SIX_HEADS = ModelConfig(**{**DENSE.__dict__, "n_head": 6, "head_dim": 16})


@pytest.mark.parametrize("cfg", [DENSE, SIX_HEADS, MOE], ids=["qwen3", "six-heads", "qwen3_moe"])
def test_logits_equal_transformers(cfg):
    cfg.check()
    hf = random_hf(cfg)
    ours = ours_of(hf, cfg).eval()
    ids = _ids((2, 24))
    seen = router_outputs(ours)
    with torch.no_grad():
        theirs = hf(ids, output_router_logits=cfg.moe.enabled)
        assert (ours(ids) - theirs.logits).abs().max().item() <= 1e-5
    if not cfg.moe.enabled:
        return
    assert len(seen) == len(theirs.router_logits) == 2  # blocks 1 and 2
    for routing, their_logits in zip(seen, theirs.router_logits):
        ours_logits = routing.logits.view(24, 2, -1).transpose(0, 1).reshape(48, -1)
        assert (ours_logits - their_logits).abs().max().item() <= 1e-6
        their_choice = their_logits.softmax(-1).topk(cfg.moe.top_k).indices
        ours_choice = routing.indices.view(24, 2, -1).transpose(0, 1).reshape(48, -1)
        assert torch.equal(ours_choice.sort(-1).values, their_choice.sort(-1).values)


@pytest.mark.parametrize("normalize", [False, True])
def test_training_gradient_and_aux_value_equal_transformers(normalize):
    """Our loss is the cross-entropy, its gradient that of CE + coeff · transformers' pooled
    aux_loss, whose value the ledger holds; norm_topk_prob either way."""
    cfg = with_moe(MOE, normalize_top_k=normalize)
    hf = random_hf(cfg).train()
    ours = ours_of(hf, cfg).train()
    ids = _ids((2, 25))
    out = hf(ids[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    (ce + cfg.moe.aux_loss_coeff * out.aux_loss).backward()
    loss = ours(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert abs(loss.item() - ce.item()) <= 1e-5
    assert abs(ours.routing.figures.pooled.item() - out.aux_loss.item()) <= 1e-5
    grads = family(cfg).hf.to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()})
    for name, p in hf.named_parameters():
        g = grads[name]
        assert (g[:p.shape[0]] - p.grad).abs().max().item() \
            <= 1e-5 * max(1.0, p.grad.abs().max().item()), name


def per_expert_layout(sd):
    """The hub's per-expert names (mlp.experts.<e>.gate_proj/up_proj/down_proj)."""
    out = {}
    for name, t in sd.items():
        m = re.match(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = t
            continue
        for e, w in enumerate(t):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.mlp.experts.{e}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{m.group(1)}.mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.mlp.experts.{e}.up_proj.weight"] = up
    return out


def test_both_expert_layouts_read_alike(tmp_path):
    """The state and a directory written in the per-expert layout read as the fused one."""
    from safetensors.torch import save_file

    hf = random_hf(MOE)
    sd = hf.state_dict()
    fused, split = from_hf_state_dict(sd), from_hf_state_dict(per_expert_layout(sd))
    assert fused.keys() == split.keys()
    assert all(torch.equal(fused[k], split[k]) for k in fused)
    hf.config.save_pretrained(tmp_path / "hub")
    save_file({k: v.contiguous() for k, v in per_expert_layout(sd).items()},
              str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_hf_state_dict(str(tmp_path / "hub"), MOE)
    assert loaded.keys() == fused.keys()
    assert all(torch.equal(loaded[k], fused[k]) for k in fused)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["qwen3", "qwen3_moe"])
def test_export_round_trip_bitwise_logits_and_greedy_text(cfg, tmp_path):
    import transformers

    ours, state = export_initialized(cfg, tmp_path / "hf")
    cls = getattr(transformers, family(cfg).hf.model_class)
    kwargs = {"experts_implementation": "eager"} if cfg.moe.enabled else {}
    hf = cls.from_pretrained(tmp_path / "hf", **kwargs).eval()
    assert hf.num_parameters() == num_parameters(cfg)
    back = load_hf_state_dict(str(tmp_path / "hf"), cfg)
    if cfg.tie_word_embeddings:  # transformers' tied head: the embedding itself
        assert torch.equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    ids = _ids((2, 20), seed=2)
    assert_logits_and_greedy_text_equal(ours, hf, ids)


def test_init_from_checks_the_config(tmp_path):
    random_hf(MOE).save_pretrained(tmp_path / "m")
    random_hf(DENSE).save_pretrained(tmp_path / "d")
    check_init_from(str(tmp_path / "m"), MOE)
    check_init_from(str(tmp_path / "d"), DENSE)
    wrong = [(with_moe(MOE, normalize_top_k=True), r"model.moe.normalize_top_k=True.*"
              r"norm_topk_prob=False"),
             (with_moe(MOE, first_dense_layers=0), r"model.moe.first_dense_layers=0.*"
              r"mlp_only_layers"),
             (with_moe(MOE, expert_size=32), r"model.moe.expert_size=32.*"
              r"moe_intermediate_size=16"),
             (with_moe(MOE, score="sigmoid"), r"model.moe.score='sigmoid'")]
    for cfg, match in wrong:
        with pytest.raises(ConfigError, match=match):
            check_init_from(str(tmp_path / "m"), cfg)
    with pytest.raises(ConfigError, match=r"model.head_dim=32: .* head_dim=24"):
        check_init_from(str(tmp_path / "d"), ModelConfig(**{**DENSE.__dict__, "head_dim": 32}))


def test_decoder_sparse_step_reads_as_layer_freq(tmp_path):
    """decoder_sparse_step=2 (blocks 1, 3 sparse) is first_dense_layers=1, layer_freq=2; a
    pattern of no such form is refused by name."""
    from transformers import Qwen3MoeConfig

    from megalite.model.qwen3.hf import layer_pattern

    def pattern(**kw):
        return layer_pattern(Qwen3MoeConfig(num_hidden_layers=5, num_experts=4, **kw), "x")

    assert pattern(decoder_sparse_step=2) == (1, 2)
    assert pattern(mlp_only_layers=[0, 1]) == (2, 1)
    with pytest.raises(ConfigError, match=r"MoE blocks \[0, 2, 3, 4\]"):
        pattern(mlp_only_layers=[1])


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "qwen3-30b-a3b",
                                    "qwen3-235b-a22b"])
def test_presets_count_as_transformers(preset):
    """Total parameters as transformers' model built on the meta device; active ones (top-k
    routed experts) those of its blocks with k of the E experts (30.5B / 3.3B, 235B / 22B)."""
    import transformers

    m = load_config([f"model={preset}"]).model
    fam = family(m)
    with torch.device("meta"):
        hf = getattr(transformers, fam.hf.model_class)(fam.hf.hf_config(m))
    assert hf.num_parameters() == num_parameters(m)
    expert = 3 * m.n_embd * m.moe.expert_hidden(m.ffn_size)
    idle = m.n_layer * (m.moe.num_experts - m.moe.top_k) * expert if m.moe.enabled else 0
    assert fam.active_parameters(m) == num_parameters(m) - idle
    # 6N + 12·L·(n_head·head_dim)·s, N = active parameters but the embedding's lookup (the
    # head's matmul counted once, tied or not)
    n = fam.active_parameters(m) - (0 if m.tie_word_embeddings else m.vocab_size * m.n_embd)
    assert flops_per_token(m, 4096) == 6 * n + 12 * m.n_layer * m.n_head * m.head_size * 4096


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_head_dim_refused_where_the_family_ties_it(arch):
    cfg = MOE if arch == "mixtral" else DENSE
    with pytest.raises(ConfigError, match=rf"^model.head_dim=24: model.arch={arch} has head_dim"):
        ModelConfig(**{**cfg.__dict__, "arch": arch}).check()


def test_tp_without_sp_refused_by_key(tiny_data):
    """The q/k norms' gradients are partial over TP and summed only under SP."""
    from megalite.config.layout import validate
    from tests.layouts import composed

    qwen3 = [f"data.dir={tiny_data}", "model.arch=qwen3", "model.n_kv_head=2", "tp=2"]
    with pytest.raises(ConfigError, match=r"^sp=False: model.arch=qwen3 with tp=2 needs sp=true"):
        validate(composed(qwen3), 2)
    validate(composed([*qwen3, "sp=true"]), 2)
