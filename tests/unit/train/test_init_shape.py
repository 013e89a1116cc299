"""`init_from` a transformers directory takes the model from its config.json
(`megalite.train.init_shape`): GPT-2, Llama, Mixtral, Qwen3 and Qwen3-MoE directories load
with no model key, their logits equal to transformers'; a model key given that disagrees with
config.json is refused by name (on the command line or through a preset), one that agrees, or
a training default (dropout, the aux coefficient), is kept."""
from __future__ import annotations

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.model import ModelConfig
from megalite.config.schema import load_config
from megalite.model.families import causal_lm, num_parameters
from megalite.model.init import load_global_state
from megalite.train.init_from import check_init_from, load_init_state
from megalite.train.init_shape import adopt_init_from_model
from tests.conftest import random_hf_gpt2, random_hf_llama
from tests.unit.model import test_mixtral, test_qwen3

GPT2 = ModelConfig(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=211, n_inner=96,
                   layer_norm_epsilon=1e-6)
LLAMA = ModelConfig(arch="llama", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, n_positions=64,
                    vocab_size=211, n_inner=96, tie_word_embeddings=False, rope_theta=50000.0)
MODELS = {"gpt2": lambda: random_hf_gpt2(GPT2),
          "llama": lambda: random_hf_llama(LLAMA),
          "mixtral": lambda: test_mixtral.random_hf_mixtral(test_mixtral.CFG),
          "qwen3": lambda: test_qwen3.random_hf(test_qwen3.DENSE),
          "qwen3_moe": lambda: test_qwen3.random_hf(test_qwen3.MOE)}


def adopted(source, *overrides):
    given = [f"init_from={source}", *overrides]
    return adopt_init_from_model(load_config(given), given)


@pytest.mark.parametrize("arch", list(MODELS))
def test_a_directory_loads_with_no_model_keys(arch, tmp_path):
    hf = MODELS[arch]()
    hf.save_pretrained(tmp_path / arch)
    source = str(tmp_path / arch)
    cfg = adopted(source)
    assert (cfg.model.arch, cfg.model.name) == (arch, source)
    assert num_parameters(cfg.model) == hf.num_parameters()
    check_init_from(source, cfg.model)
    ours = causal_lm(cfg.model).eval()
    load_global_state(ours, load_init_state(source, cfg.model))
    ids = torch.randint(0, 211, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-5


def test_a_disagreeing_key_is_refused_by_name(tmp_path):
    test_qwen3.random_hf(test_qwen3.MOE).save_pretrained(tmp_path / "m")
    source = tmp_path / "m"
    refused = [(["model.n_layer=5"], r"^model.n_layer=5: init_from='.*' has 3 \(config.json\); "
                r"drop model.n_layer"),
               (["model.head_dim=32"], r"^model.head_dim=32: .* has 24"),
               (["model.moe.top_k=1"], r"^model.moe.top_k=1: .* has 2"),
               (["model.moe.score=sigmoid"], r"^model.moe.score='sigmoid': .* has 'softmax'"),
               (["model=llama-tiny"], r"^model.n_layer=4: .* has 3"),
               (["model.arch=mixtral"], r"^model.arch='mixtral': .* has 'qwen3_moe'")]
    for overrides, match in refused:
        with pytest.raises(ConfigError, match=match):
            adopted(source, *overrides)
    kept = adopted(source, "model.n_layer=3", "model.attn_pdrop=0.2",
                   "model.moe.aux_loss_coeff=0.5").model
    assert (kept.n_layer, kept.attn_pdrop, kept.moe.aux_loss_coeff) == (3, 0.2, 0.5)
    default = adopted(source).model  # config.json's router_aux_loss_coef and dropout
    assert (default.moe.aux_loss_coeff, default.attn_pdrop) == (0.05, 0.0)


def test_a_checkpoint_keeps_the_model_config(tmp_path):
    """Not a transformers directory: the composed config as it is (its own checks apply)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text("{}")
    cfg = load_config([f"init_from={tmp_path / 'ckpt'}"])
    assert adopt_init_from_model(cfg, [f"init_from={tmp_path / 'ckpt'}"]) is cfg


@pytest.mark.slow
def test_a_qwen3_moe_directory_gives_transformers_validation_loss(tiny_data, tmp_path):
    """A trainer of the config `init_from` a Qwen3MoeForCausalLM directory makes (the shape
    keys given agree; family, heads, experts and router from config.json): its validation loss
    equals transformers' cross-entropy on the same windows within 1e-5."""
    import torch.nn.functional as F

    from megalite.config.layout import validate
    from megalite.config.moe import MoEConfig
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime
    from tests.layouts import FP32_NO_DROPOUT, TINY

    shape = ModelConfig(arch="qwen3_moe", n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                        head_dim=24, n_positions=64, vocab_size=1024, n_inner=48,
                        tie_word_embeddings=False,
                        moe=MoEConfig(num_experts=4, top_k=2, expert_size=16,
                                      normalize_top_k=True, aux_loss_coeff=0.05))
    hf = test_qwen3.random_hf(shape)
    hf.save_pretrained(tmp_path / "qwen3-moe")
    overrides = [*TINY, *FP32_NO_DROPOUT, f"data.dir={tiny_data}",
                 f"init_from={tmp_path / 'qwen3-moe'}"]
    cfg = adopt_init_from_model(load_config(overrides), overrides)
    validate(cfg, 1)
    trainer = build_trainer(cfg, init_runtime(cfg), tmp_path / "run")
    ours = trainer.evaluate()
    with torch.no_grad():
        losses = [F.cross_entropy(hf(batch[0]).logits.reshape(-1, 1024), batch[1].reshape(-1))
                  for batch in trainer.val_batches()]
    assert abs(ours - sum(losses).item() / len(losses)) <= 1e-5
