"""Expert-parallel checkpoints and transformers, one 4-rank launch (fp32, rel 1e-5):
ep 2 folded over tp 2 with SP under ZeRO 3 and optimizer offload (0.5) equals the serial run,
and its checkpoint after step 1 resumes at tp 2 ep 1 and at ep 4 over tp 2 x dp 2 continuing
the uninterrupted serial run; a Qwen3-MoE started from a transformers directory (init_from)
at ep 2 x tp 2 with SP trains as the serial run started from it; `megalite-export` of that
run's checkpoint and of a Mixtral's at ep 2 over dp gives the transformers model of the
serial run's trained weights — logits equal to megalite's serial model's, nothing missing,
and every exported expert the trained one, none left at its initial weights."""
from __future__ import annotations

import pytest
import torch

from megalite.checkpoint.export import model_config
from megalite.cli.export import main as megalite_export
from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.model.families import causal_lm
from megalite.model.init import load_global_state
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import (
    Later,
    Prepared,
    assert_equal,
    from_step,
    serial_global,
    train_in_process,
    train_layouts,
)

pytestmark = pytest.mark.distributed

STEPS = 3
TP_LR = ["optim.lr=2e-3"]  # EP folded over TP (as test_expert_parallel's)
NO_BIAS = [o for o in MOE if "bias_update_rate" not in o]  # MixtralForCausalLM has no bias
QWEN3_MOE = ModelConfig(arch="qwen3_moe", n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                        head_dim=24, n_positions=64, vocab_size=1024, n_inner=48,
                        tie_word_embeddings=False,
                        moe=MoEConfig(num_experts=4, top_k=2, expert_size=16))

QWEN3_KEYS = ["model.arch=qwen3_moe", "model.n_kv_head=2", "model.head_dim=24", "model.n_inner=48",
              "model.tie_word_embeddings=false", "model.moe.num_experts=4", "model.moe.top_k=2",
              "model.moe.expert_size=16"]


def initial_weights(trainer):
    """Prepared's callable: the run's parameters before its first step (its "extra")."""
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return lambda: start


def _transformers_dir(path):
    """A random Qwen3MoeForCausalLM of QWEN3_MOE saved at `path` (what init_from reads)."""
    from tests.unit.model.test_qwen3 import random_hf

    random_hf(QWEN3_MOE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("serial-ep-interop")
    data = f"data.dir={tiny_data}"
    qwen = [data, f"init_from={_transformers_dir(root / 'hf-qwen3-moe')}", *TP_LR, *QWEN3_KEYS]
    return {"tp": train_in_process(root / "t", [data, *MOE, *TP_LR], STEPS),
            "qwen": train_in_process(root / "q", Prepared(qwen, initial_weights), STEPS),
            "mixtral": train_in_process(root / "m", Prepared([data, *NO_BIAS], initial_weights),
                                        STEPS),
            "runs": {"qwen": qwen, "mixtral": [data, *NO_BIAS]}}


def _assert_exported(step, out, reference, hf_class):
    """`megalite-export step out` loads in transformers (no key missing or left over) as the
    reference serial run's weights after step 1: every tensor, each expert of every layer
    (which moved from its initial weights), and the logits of megalite's serial model."""
    megalite_export([str(step), str(out)])
    hf, info = hf_class.from_pretrained(out, experts_implementation="eager",
                                        output_loading_info=True)
    assert not any(info.values()), info
    trained, specs = serial_global(reference, 0), reference["specs"]
    start = {specs[n].name: specs[n].unshard([t]) for n, t in reference["extra"].items()}
    theirs = hf.eval().state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(theirs[name], value, rtol=1e-5, atol=1e-6, msg=name)
    experts = [name for name in trained if ".mlp.experts." in name]
    assert len(experts) == 4  # 2 layers x (gate_up_proj, down_proj), [E, ...] each
    # AdamW's first update moves each weight with a gradient by about the step's learning
    # rate (m / sqrt(v) = sign(g)), the dense weights' largest move; weight decay alone by a
    # thousandth of it
    step_size = max((trained[n] - start[n]).abs().max() for n in trained if n not in experts)
    for name in experts:
        assert len(theirs[name]) == 4
        for e, (got, want, initial) in enumerate(zip(theirs[name], trained[name], start[name])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name}[{e}]")
            assert (got - initial).abs().max() > step_size / 2, (name, e, step_size)
    ours = causal_lm(model_config(step)).eval()
    load_global_state(ours, trained)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-5


def test_ep_checkpoints_resume_export_and_init_from_transformers(tiny_data, tmp_path, serial):
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    common, ckpt = [f"data.dir={tiny_data}", *MOE, *TP_LR], tmp_path / "ckpt"
    step = ckpt / "step_00000001"
    # the ep 2 x tp 2 checkpoint at tp 2 x dp 2: ep 1 (every expert on every rank) and ep 4
    resumed = [Later(common + ["tp=2", "sp=true", f"ep={ep}", "zero=1",
                               f"checkpoint.resume={step}"], STEPS - 1) for ep in (1, 4)]
    runs = [common + ["ep=2", "tp=2", "sp=true", "zero=3", "offload.optimizer=0.5",
                      f"checkpoint.dir={ckpt}"],
            *resumed,
            serial["runs"]["qwen"] + ["ep=2", "tp=2", "sp=true", "zero=1",
                                      f"checkpoint.dir={tmp_path / 'qwen'}"],
            serial["runs"]["mixtral"] + ["ep=2", "zero=1",
                                         f"checkpoint.dir={tmp_path / 'mixtral'}"]]
    folded, *at, qwen, mixtral = train_layouts(tmp_path, 4, runs, STEPS, save_at=1)
    assert_equal(serial["tp"], folded)
    assert_figures_equal(serial["tp"], folded)
    expected = {**from_step(serial["tp"], 1), "moe": serial["tp"]["moe"][1:]}
    for ranks in at:
        assert_equal(expected, ranks)
        assert_figures_equal(expected, ranks)
    for reference, ranks in ((serial["qwen"], qwen), (serial["mixtral"], mixtral)):
        assert_equal(reference, ranks)
        assert_figures_equal(reference, ranks)
    _assert_exported(tmp_path / "qwen" / "step_00000001", tmp_path / "hf-qwen",
                     serial["qwen"], Qwen3MoeForCausalLM)
    _assert_exported(tmp_path / "mixtral" / "step_00000001", tmp_path / "hf-mixtral",
                     serial["mixtral"], MixtralForCausalLM)
