"""GPT-2 architecture parity with transformers.GPT2LMHeadModel, init statistics, FLOP formula."""
import math

import pytest
import torch
import torch.nn.functional as F

from megalite.config.errors import ConfigError
from megalite.config.schema import ModelConfig
from megalite.model.families import flops_per_token, num_parameters
from megalite.model.gpt2.hf import from_hf_state_dict, hf_config
from megalite.model.gpt2.stage import GPT2
from megalite.model.hf_io import check_init_from, load_hf_state_dict, save_hf
from megalite.model.init import init_parameters, load_global_state
from tests.conftest import random_hf_gpt2

SMALL = ModelConfig(name="t", n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=211,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(cfg, seed=0):
    return random_hf_gpt2(cfg, seed)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SMALL, ModelConfig(name="v", n_layer=2, n_embd=48, n_head=3,
                                                     n_positions=32, vocab_size=50257, n_inner=80,
                                                     resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attn_pdrop=0.0)])
def test_logits_and_loss_match_hf(cfg):
    hf = hf_model(cfg)
    ours = GPT2(cfg).eval()
    load_global_state(ours, from_hf_state_dict(hf.state_dict()))
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
    assert count_parameters(ours) == sum(p.numel() for p in hf.parameters()) == num_parameters(SMALL)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert ours.transformer.wte.weight.shape == (256, SMALL.n_embd)  # vocab 211 padded to 128


@pytest.mark.slow
def test_gpt2_presets_have_hf_parameter_counts():
    # Published sizes: 124M, 355M, 774M, 1558M (unique parameters, tied embedding once).
    from megalite.config.schema import load_config

    expected = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                "gpt2-xl": 1_557_611_200}
    for name, n in expected.items():
        m = load_config([f"model={name}"]).model
        assert num_parameters(m) == n, name
        with torch.device("meta"):
            assert count_parameters(GPT2(m)) == n, name


@pytest.mark.slow
def test_init_statistics():
    cfg = ModelConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=1000)
    m = GPT2(cfg)
    init_parameters(m, seed=0)
    def std(t):
        return t.float().std().item()
    h0 = m.transformer.h["0"]
    assert std(h0.attn.c_attn.weight) == pytest.approx(0.02, rel=0.05)
    assert std(h0.mlp.c_proj.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert std(h0.attn.c_proj.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert h0.ln_1.weight.eq(1).all() and h0.attn.c_attn.bias.eq(0).all()
    assert m.transformer.wte.weight[1000:].eq(0).all()  # vocabulary padding rows


def test_init_is_independent_of_construction_order():
    """Each tensor's initial value depends only on the seed and its global name."""
    a = GPT2(SMALL)
    init_parameters(a, seed=5)
    b = GPT2(SMALL, blocks=range(1, 3), first=False, last=True)  # a later pipeline stage
    init_parameters(b, seed=5)
    for name, p in b.named_parameters():
        ref = dict(a.named_parameters())["transformer.wte.weight" if name == "lm_head.weight" else name]
        assert torch.equal(p, ref), name


def test_flops_per_token_formula():
    cfg = SMALL
    n_matmul = num_parameters(cfg) - cfg.n_positions * cfg.n_embd
    assert flops_per_token(cfg, 32) == 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * 32


@pytest.mark.slow
def test_hf_directory_round_trip_and_shape_mismatch(tmp_path):
    from transformers import GPT2LMHeadModel

    ours = GPT2(SMALL)
    init_parameters(ours, seed=3)
    state = {spec.name: spec.unshard([p.detach()]) for (name, p), spec in
             zip(ours.named_parameters(), ours.param_specs.values())}
    save_hf(state, SMALL, tmp_path / "hf")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, SMALL.vocab_size, (1, 9))
    with torch.no_grad():
        assert (back(ids).logits - ours.eval()(ids)).abs().max() <= 1e-5
    loaded = load_hf_state_dict(str(tmp_path / "hf"), SMALL)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    wrong = ModelConfig(**{**SMALL.__dict__, "n_layer": 4})
    with pytest.raises(ConfigError, match="model.n_layer=4"):
        load_hf_state_dict(str(tmp_path / "hf"), wrong)
    # the check before launch reads config.json alone and finds the same mismatch
    check_init_from(str(tmp_path / "hf"), SMALL)
    with pytest.raises(ConfigError, match="model.n_layer=4"):
        check_init_from(str(tmp_path / "hf"), wrong)
    with pytest.raises(ConfigError, match="init_from=.*nowhere.*no GPT-2 config.json"):
        check_init_from(str(tmp_path / "nowhere"), SMALL)
    for key, value in (("activation_function", "relu"), ("tie_word_embeddings", False),
                       ("scale_attn_by_inverse_layer_idx", True), ("layer_norm_epsilon", 1e-6)):
        other = hf_config(SMALL)
        setattr(other, key, value)
        other.save_pretrained(tmp_path / key)
        with pytest.raises(ConfigError, match=f"{key}"):
            check_init_from(str(tmp_path / key), SMALL)


def test_attention_kernel_choice_changes_no_result():
    """train.attention picks SDPA's kernel only: the math and flash kernels give auto's loss and
    gradients (fp32), a kernel that cannot run the inputs raises instead of falling back."""
    from megalite.config.train_section import ATTENTION_CHOICES
    from megalite.model.attention import BACKENDS

    assert ATTENTION_CHOICES == ("auto", *BACKENDS)
    ids = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    results = {}
    for choice in ("auto", "flash", "math", "cudnn"):
        model = GPT2(SMALL, attention=choice)
        init_parameters(model, seed=0)
        if choice == "cudnn":  # CUDA only: no silent fallback on CPU
            with pytest.raises(RuntimeError):
                model(ids[:, :-1], ids[:, 1:])
            continue
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results[choice] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    for choice in ("flash", "math"):
        assert abs(results[choice][0] - results["auto"][0]) <= 1e-6
        assert torch.allclose(results[choice][1], results["auto"][1], rtol=1e-4, atol=1e-6)


def test_generation_stops_at_the_end_of_the_document():
    """Greedy decoding from a model that counts upwards and wraps to token 0 (EOS here):
    generation ends with the EOS token, as transformers' generate does, unless told not to."""
    from megalite.model.generate import generate

    class Counter(torch.nn.Module):
        cfg = ModelConfig(n_layer=1, n_embd=4, n_head=1, n_positions=16, vocab_size=8)

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids):
            return F.one_hot((ids + 1) % 8, 8).float()  # next token = this one + 1

    assert generate(Counter(), [5], 10, temperature=0, eos_token_id=0) == [5, 6, 7, 0]
    assert generate(Counter(), [5], 5, temperature=0) == [5, 6, 7, 0, 1, 2]


def count_parameters(model: GPT2) -> int:
    """Parameters of the global model held (in part) by this stage, each counted once, without
    vocabulary padding: for tp = pp = 1, GPT2LMHeadModel's count."""
    return sum(math.prod(s.shape) for s in model.param_specs.values() if not s.tied_copy)
