"""GPT-2 architecture parity with transformers.GPT2LMHeadModel, init statistics, FLOP formula."""
import math

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ConfigError, ModelConfig
from megalite.model.gpt2 import GPT2, count_parameters, flops_per_token
from megalite.model.hf import from_hf_state_dict, hf_config, load_hf_state_dict, save_hf

SMALL = ModelConfig(name="t", n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=211,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(cfg, seed=0):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(hf_config(cfg)).eval()


@pytest.mark.parametrize("cfg", [SMALL, ModelConfig(name="v", n_layer=2, n_embd=48, n_head=3,
                                                     n_positions=32, vocab_size=50257, n_inner=80,
                                                     resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attn_pdrop=0.0)])
def test_logits_and_loss_match_hf(cfg):
    hf = hf_model(cfg)
    ours = GPT2(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        logits = ours(ids)
        loss = ours(ids[:, :-1], ids[:, 1:])
    assert (logits - ref.logits).abs().max().item() <= 1e-4
    # HF shifts labels internally: loss over positions 0..s-2 predicting 1..s-1.
    ref_loss = F.cross_entropy(ref.logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - ref.loss.item()) <= 1e-5
    assert abs(loss.item() - ref_loss.item()) <= 1e-5


def test_parameter_count_matches_hf_and_embedding_is_tied():
    hf = hf_model(SMALL)
    ours = GPT2(SMALL)
    assert count_parameters(ours) == sum(p.numel() for p in hf.parameters())
    assert ours.lm_head.weight is ours.transformer.wte.weight


def test_gpt2_presets_have_hf_parameter_counts():
    # Published sizes: 124M, 355M, 774M, 1558M (unique parameters, tied embedding once).
    from megalite.config import load_config

    expected = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                "gpt2-xl": 1_557_611_200}
    for name, n in expected.items():
        m = load_config([f"model={name}"]).model
        with torch.device("meta"):
            assert count_parameters(GPT2(m)) == n, name


def test_init_statistics():
    cfg = ModelConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=1000)
    torch.manual_seed(0)
    m = GPT2(cfg)
    std = lambda t: t.float().std().item()
    assert std(m.transformer.h[0].attn.c_attn.weight) == pytest.approx(0.02, rel=0.05)
    assert std(m.transformer.h[0].mlp.c_proj.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert std(m.transformer.h[0].attn.c_proj.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert m.transformer.h[0].ln_1.weight.eq(1).all() and m.transformer.h[0].attn.c_attn.bias.eq(0).all()


def test_flops_per_token_formula():
    cfg = SMALL
    n_matmul = count_parameters(GPT2(cfg)) - cfg.n_positions * cfg.n_embd
    assert flops_per_token(cfg, 32) == 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * 32


def test_hf_directory_round_trip_and_shape_mismatch(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(3)
    ours = GPT2(SMALL)
    save_hf(ours.state_dict(), SMALL, tmp_path / "hf")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, SMALL.vocab_size, (1, 9))
    with torch.no_grad():
        assert (back(ids).logits - ours.eval()(ids)).abs().max() <= 1e-5
    loaded = load_hf_state_dict(str(tmp_path / "hf"), SMALL)
    for k, v in ours.state_dict().items():
        assert torch.equal(loaded[k], v), k
    wrong = ModelConfig(**{**SMALL.__dict__, "n_layer": 4})
    with pytest.raises(ConfigError, match="model.n_layer=4"):
        load_hf_state_dict(str(tmp_path / "hf"), wrong)
