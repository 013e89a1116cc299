"""The Llama family in one process: logits equal transformers' `LlamaForCausalLM` on the same
weights (grouped-query attention, rope_theta, Llama 3's RoPE scaling, tied and untied heads),
the export loads back with equal logits and greedy generation, RMSNorm's gradients, the
parameter count and FLOPs, and the refusals before launch."""
from __future__ import annotations

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.model import ModelConfig, RopeScaling
from megalite.config.schema import load_config
from megalite.model.families import causal_lm, flops_per_token, num_parameters
from megalite.model.hf_io import check_init_from, load_hf_state_dict
from megalite.model.init import load_global_state
from megalite.model.llama.hf import from_hf_state_dict
from megalite.model.llama.stage import RMSNorm
from tests.conftest import random_hf_gpt2, random_hf_llama
from tests.hf_export import assert_logits_and_greedy_text_equal, export_initialized
from tests.unit.eval.test_hellaswag import (
    assert_scores,
    serial_trainer,
    transformers_scores,
    write_hellaswag,
)

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
GQA = ModelConfig(name="gqa", arch="llama", n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                  n_positions=64, vocab_size=211, n_inner=96, tie_word_embeddings=False,
                  rope_theta=50000.0, **NO_DROPOUT)
SCALED = ModelConfig(name="scaled", arch="llama", n_layer=2, n_embd=64, n_head=8, n_kv_head=2,
                     n_positions=256, vocab_size=300, n_inner=80, tie_word_embeddings=True,
                     rope_theta=500000.0, layer_norm_epsilon=1e-6,
                     rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32),
                     **NO_DROPOUT)


def max_logit_error(cfg: ModelConfig, length: int = 40) -> float:
    hf = random_hf_llama(cfg)
    ours = causal_lm(cfg).eval()
    load_global_state(ours, from_hf_state_dict(hf.state_dict()))
    ids = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("cfg", [GQA, SCALED], ids=["gqa-theta", "llama3-scaling-tied"])
def test_logits_equal_transformers(cfg):
    """fp32 logits within 1e-5 of LlamaForCausalLM's (SCALED: positions past the original
    context of 32, where Llama 3's scaling changes the low frequencies)."""
    assert max_logit_error(cfg) <= 1e-5


def test_rope_scaling_changes_logits():
    """The scaled config's logits differ from the unscaled one's (the scaling is not a no-op
    the test above could pass without)."""
    hf = random_hf_llama(SCALED)
    plain = ModelConfig(**{**SCALED.__dict__, "rope_scaling": None})
    ours = causal_lm(plain).eval()
    load_global_state(ours, from_hf_state_dict(hf.state_dict()))
    ids = torch.randint(0, SCALED.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() > 1e-3


def test_export_loads_in_transformers_with_equal_logits_and_generation(tmp_path):
    from transformers import LlamaForCausalLM

    ours, state = export_initialized(GQA, tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.num_parameters() == num_parameters(GQA)
    ids = torch.randint(0, GQA.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_logits_and_greedy_text_equal(ours, hf, ids)
    back = load_hf_state_dict(str(tmp_path / "hf"), GQA)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)


def test_init_from_checks_architecture_and_shape(tmp_path):
    random_hf_llama(GQA).save_pretrained(tmp_path / "llama")
    check_init_from(str(tmp_path / "llama"), GQA)
    with pytest.raises(ConfigError, match=r"model.n_kv_head=2: .*num_key_value_heads=2|"
                       r"model.n_kv_head=1: .*num_key_value_heads=2"):
        check_init_from(str(tmp_path / "llama"), ModelConfig(**{**GQA.__dict__, "n_kv_head": 1}))
    with pytest.raises(ConfigError, match="model.rope_theta=10000.0: .*rope_theta=50000.0"):
        check_init_from(str(tmp_path / "llama"),
                        ModelConfig(**{**GQA.__dict__, "rope_theta": 10000.0}))
    gpt2 = ModelConfig(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=211)
    random_hf_gpt2(gpt2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="a 'gpt2' model, but model.arch=llama reads "
                       "LlamaForCausalLM .*set model.arch=gpt2"):
        check_init_from(str(tmp_path / "gpt2"), GQA)
    with pytest.raises(ConfigError, match="a 'llama' model, but model.arch=gpt2 .*"
                       "set model.arch=llama"):
        check_init_from(str(tmp_path / "llama"), gpt2)


def test_rmsnorm_gradients_equal_autograd():
    """The hand-written backward against autograd through transformers' formula (fp32)."""
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(5, 3, 16, requires_grad=True)
    grad = torch.randn(5, 3, 16)
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), grad)
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    rdx, rdw = torch.autograd.grad(reference, (x, norm.weight), grad)
    torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset,parameters", [("llama3.2-1b", 1_235_814_400),
                                               ("llama3-8b", 8_030_261_248),
                                               ("llama3.1-8b", 8_030_261_248),
                                               ("llama3.1-70b", 70_553_706_496),
                                               ("llama3.1-405b", 405_853_388_800),
                                               ("llama-tiny", 2_884_736)])
def test_presets_have_transformers_parameter_counts(preset, parameters):
    """Meta's published shapes: Llama 3.2 1B 1.24B (tied head), Llama 3 and 3.1 8B 8.03B,
    Llama 3.1 70B 70.55B and 405B 405.85B; the counts as transformers builds them (on the
    meta device: no memory)."""
    from transformers import LlamaForCausalLM

    from megalite.model.llama.hf import hf_config

    cfg = load_config([f"model={preset}"]).model
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config(cfg))
    assert num_parameters(cfg) == hf.num_parameters() == parameters


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.1-70b", "llama3.1-405b"])
def test_llama31_presets_scale_rope_as_transformers(preset):
    """The long-context presets: 131,072 positions and Llama 3.1's scaling (factor 8 over
    8,192, low 1, high 4), carried to transformers' config (`hf_config`) and back (`rope_of`),
    with inverse frequencies equal to transformers' LlamaRotaryEmbedding's for that config
    (rope_type llama3) and not to the unscaled ones."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megalite.model.llama.hf import hf_config, rope_of
    from megalite.model.llama.rope import inverse_frequencies

    cfg = load_config([f"model={preset}"]).model
    assert cfg.n_positions == 131072 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)
    hf = hf_config(cfg)
    theta, scaling = rope_of(hf)
    assert theta == 500000.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert hf.max_position_embeddings == 131072
    theirs = LlamaRotaryEmbedding(hf).inv_freq
    torch.testing.assert_close(inverse_frequencies(cfg), theirs, rtol=0, atol=0)
    plain = inverse_frequencies(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    assert not torch.equal(plain, theirs)


def test_a_context_beyond_the_preset_names_the_long_context_presets():
    """llama3-8b has 8,192 positions: seq_len 32768 is refused naming llama3.1-8b (its shape
    with 131,072) and the other llama presets that long."""
    cfg = load_config(["model=llama3-8b", "train.seq_len=32768", "train.micro_batch_size=1",
                       "train.global_batch_size=8"])
    with pytest.raises(ConfigError, match=r"train.seq_len=32768: .*model.n_positions=8192.* "
                       r"model=llama3.1-8b \(this shape, 131,072 positions\), llama3.2-1b "
                       r"\(131,072\), llama3.1-70b \(131,072\), llama3.1-405b"):
        validate(cfg, 8)
    validate(load_config(["model=llama3.1-8b", "train.seq_len=32768",
                          "train.micro_batch_size=1", "train.global_batch_size=8"]), 8)


def test_flops_per_token_is_6n_plus_attention():
    """6N + 12·L·h·s with N = every parameter but the token embedding's lookup: the LM head's
    matmul counts once, tied or not (GQA shrinks N through k and v, not the attention term)."""
    s = 32
    for cfg in (GQA, SCALED):
        n = num_parameters(cfg) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.n_embd)
        assert flops_per_token(cfg, s) == 6 * n + 12 * cfg.n_layer * cfg.n_embd * s


LLAMA = ["model=llama-tiny", "device=cpu"]


@pytest.mark.parametrize("overrides,message", [
    (["model.n_kv_head=3"], r"model.n_kv_head=3: must divide model.n_head=4 .*\[1, 2, 4\]"),
    (["tp=4", "model.n_kv_head=1", "model.n_head=8"], None),  # replicated: accepted
    (["tp=4", "model.n_kv_head=8", "model.n_head=8", "model.n_kv_head=6"], "model.n_kv_head=6"),
    (["tp=2", "model.n_head=12", "model.n_kv_head=3", "model.n_embd=192", "model.n_inner=384"],
     r"tp=2: must divide model.n_kv_head=3 .* or be a multiple of it"),
    (["tp=8", "model.n_head=24", "model.n_kv_head=6", "model.n_embd=192"],
     r"tp=8: is larger than model.n_kv_head=6 but not a multiple of it"),
    (["model.arch=gpt2", "model.tie_word_embeddings=true", "model.n_kv_head=2"],
     "model.n_kv_head=2: GPT-2 has no grouped"),
    (["model.arch=gpt2", "model.tie_word_embeddings=false"], "model.tie_word_embeddings"),
    (["model.n_embd=120", "model.n_head=4", "model.n_inner=96"], None),
    (["model.n_embd=20", "model.n_head=4", "model.n_kv_head=4"], "head_dim .* must be even"),
    (["model=llama3.2-1b", "model.rope_scaling.high_freq_factor=0.5"],
     "model.rope_scaling.high_freq_factor=0.5: must be > "),
])
def test_bad_llama_configs_are_refused_before_launch(overrides, message):
    cfg = load_config(LLAMA + overrides + ["train.seq_len=64", "model.vocab_size=8192"])
    world = cfg.tp
    if message is None:
        validate(cfg, world)
        return
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world)


def test_hellaswag_scores_equal_transformers(tiny_data, tmp_path):
    """HellaSwag during training scores a Llama as LlamaForCausalLM does on the same random
    weights (its export): per-ending losses, counts, acc and acc_norm."""
    llama = ["model.arch=llama", "model.n_kv_head=2", "model.n_inner=96",
             "model.tie_word_embeddings=false"]
    writer = serial_trainer(tiny_data, tmp_path / "random", *llama)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in writer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    checkpoint = writer.save()
    data = write_hellaswag(tmp_path / "hellaswag.jsonl")
    run = serial_trainer(tiny_data, tmp_path / "run", *llama, f"init_from={checkpoint}",
                         f"eval.hellaswag={data}", "eval.hellaswag_examples=7",
                         "train.micro_batch_size=8", "train.eval_every=1000")
    assert_scores(run.evaluate_hellaswag(), transformers_scores(checkpoint, 7, seq_len=32))
