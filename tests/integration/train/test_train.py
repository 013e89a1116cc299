"""Trainer on real gloo ranks: data parallelism equals the serial run (gradient integrity),
replicas stay identical (state consistency), schedule and clipping behave."""
import math

import pytest
import torch

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.unit.train.test_train import FP32_NO_DROPOUT


def _train(rank, world, overrides, run_dir):
    cfg = load_config(TINY + FP32_NO_DROPOUT + overrides)
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    records = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [(r["loss"], r["grad_norm"], r["val_loss"]) for r in records], params


def _close(a, b, rel=1e-5):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.distributed
@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_equals_serial(tiny_data, tmp_path, dp):
    common = [f"data.dir={tiny_data}", "train.max_steps=10", "train.eval_every=5",
              "train.micro_batch_size=2"]
    (serial, serial_params), = run_ranks(_train, 1, args=(common, str(tmp_path / "s")))
    results = run_ranks(_train, dp, args=(common, str(tmp_path / "p")))
    assert len(serial) == 10
    for rank, (records, params) in enumerate(results):
        for step, ((l1, g1, v1), (l2, g2, v2)) in enumerate(zip(serial, records)):
            assert _close(l1, l2) and _close(g1, g2), (rank, step, l1, l2, g1, g2)
            assert (v1 is None) == (v2 is None) and (v1 is None or _close(v1, v2))
        for name, p in params.items():  # state consistency: every replica = serial
            torch.testing.assert_close(p, serial_params[name], rtol=1e-5, atol=1e-6)
    assert serial[-1][0] < serial[0][0]


@pytest.mark.distributed
def test_gradient_accumulation_equals_one_big_micro_batch(tiny_data, tmp_path):
    common = [f"data.dir={tiny_data}", "train.max_steps=4", "train.eval_every=0"]
    (big, _), = run_ranks(_train, 1, args=(common + ["train.micro_batch_size=16"], str(tmp_path)))
    (acc, _), = run_ranks(_train, 1, args=(common + ["train.micro_batch_size=2"], str(tmp_path)))
    for (l1, g1, _), (l2, g2, _) in zip(big, acc):
        assert _close(l1, l2) and _close(g1, g2)
