"""Qwen3 (dense) on real gloo ranks: training equals the serial run (fp32, dropout 0: losses,
grad norms, validation loss, every parameter slice after every step) under tp2 + SP, whose q/k
norm weights each TP rank holds whole but uses on its own heads (their gradients summed over
TP), with the KV heads split and replicated (n_kv_head = 1 < tp), under pp2 and cp2; tp2 without
SP is refused by key (`tests/unit/model/test_qwen3.py`). A Qwen3-MoE (a dense first block,
aux loss, z-loss and aux-loss-free bias on) under dp2 with ZeRO 3, as Mixtral's
(`test_moe_layouts.py`): parameters and the per-layer figures, and so the bias."""
from __future__ import annotations

import pytest

from tests.integration.model.test_moe_layouts import assert_figures_equal
from tests.layouts import assert_equal, train_in_process, train_layouts

pytestmark = pytest.mark.distributed

STEPS = 4
QWEN3_MOE = ["model.arch=qwen3_moe", "model.n_layer=3", "model.n_kv_head=2", "model.head_dim=24",
             "model.n_inner=48", "model.rope_theta=50000", "model.tie_word_embeddings=false",
             "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_size=16",
             "model.moe.normalize_top_k=false", "model.moe.first_dense_layers=1",
             "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
             "model.moe.bias_update_rate=0.01", "optim.lr=1e-2"]
QWEN3 = ["model.arch=qwen3", "model.n_layer=4", "model.n_kv_head=2", "model.head_dim=24",
         "model.n_inner=96", "model.tie_word_embeddings=true", "model.rope_theta=50000"]


def _common(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *QWEN3, *extra]


def test_tp2_sp_pp2_cp2_and_moe_dp2_equal_serial(tiny_data, tmp_path):
    kv1 = ["model.n_kv_head=1"]
    moe = [f"data.dir={tiny_data}", *QWEN3_MOE]
    serial = {"kv2": train_in_process(tmp_path / "kv2", _common(tiny_data), STEPS),
              "kv1": train_in_process(tmp_path / "kv1", _common(tiny_data, *kv1), STEPS),
              "moe": train_in_process(tmp_path / "moe", moe, STEPS)}
    layouts = [("kv2", _common(tiny_data, "tp=2", "sp=true")),
               ("kv1", _common(tiny_data, "tp=2", "sp=true", *kv1)),
               ("kv2", _common(tiny_data, "pp=2")), ("kv2", _common(tiny_data, "cp=2")),
               ("moe", [*moe, "zero=3"])]
    results = train_layouts(tmp_path / "w2", 2, [run for _, run in layouts], STEPS)
    for (reference, _), ranks in zip(layouts, results):
        assert_equal(serial[reference], ranks)
    assert all(len(step) == 2 for step in serial["moe"]["moe"])  # blocks 1, 2: MoE
    assert_figures_equal(serial["moe"], results[-1])
