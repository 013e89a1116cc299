"""Qwen3 (dense) on real gloo ranks: training equals the serial run (fp32, dropout 0: losses,
grad norms, validation loss, every parameter slice after every step) under tp2 + SP, whose q/k
norm weights each TP rank holds whole but uses on its own heads (their gradients summed over
TP), with the KV heads split and replicated (n_kv_head = 1 < tp), under pp2 and cp2; tp2 without
SP is refused by key (`tests/unit/model/test_qwen3.py`)."""
from __future__ import annotations

import pytest

from tests.layouts import assert_equal, train_in_process, train_layouts

pytestmark = pytest.mark.distributed

STEPS = 4
QWEN3 = ["model.arch=qwen3", "model.n_layer=4", "model.n_kv_head=2", "model.head_dim=24",
         "model.n_inner=96", "model.tie_word_embeddings=true", "model.rope_theta=50000"]


def _common(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *QWEN3, *extra]


def test_tp2_sp_pp2_and_cp2_equal_serial(tiny_data, tmp_path):
    kv1 = ["model.n_kv_head=1"]
    serial = {"kv2": train_in_process(tmp_path / "kv2", _common(tiny_data), STEPS),
              "kv1": train_in_process(tmp_path / "kv1", _common(tiny_data, *kv1), STEPS)}
    layouts = [("kv2", ["tp=2", "sp=true"]), ("kv1", ["tp=2", "sp=true", *kv1]),
               ("kv2", ["pp=2"]), ("kv2", ["cp=2"])]
    results = train_layouts(tmp_path / "w2", 2, [_common(tiny_data, *extra)
                                                 for _, extra in layouts], STEPS)
    for (reference, _), ranks in zip(layouts, results):
        assert_equal(serial[reference], ranks)
