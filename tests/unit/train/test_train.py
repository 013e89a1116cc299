"""Trainer on real gloo ranks: data parallelism equals the serial run (gradient integrity),
replicas stay identical (state consistency), schedule and clipping behave."""
import pytest

from megalite.config.layout import validate
from megalite.config.schema import OptimConfig, load_config
from megalite.train.build import build_trainer
from megalite.train.optim import lr_at
from megalite.train.runtime import init_runtime
from tests.conftest import TINY

FP32_NO_DROPOUT = ["precision=fp32", "model.resid_pdrop=0", "model.embd_pdrop=0",
                   "model.attn_pdrop=0", "log.every=1", "log.wandb=false"]


def test_lr_schedule_warmup_then_cosine_to_min():
    o = OptimConfig(lr=1.0, min_lr=0.2, warmup_steps=10)
    assert [lr_at(s, o, 110) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # from 0
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(110, o, 110) == pytest.approx(0.1) and lr_at(500, o, 110) == 0.1
    lrs = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("schedule,at_60,at_100", [
    ("linear", 0.55, 0.19),        # half way: (1 + 0.1) / 2; 90% of the way: 1 - 0.9 * 0.9
    ("constant", 1.0, 1.0),
    ("wsd", 1.0, 0.55),            # stable until step 90 (the last 20 of 100 steps decay)
])
def test_other_lr_schedules(schedule, at_60, at_100):
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule)
    assert lr_at(0, o, 110) == pytest.approx(0.1)  # the same warmup
    assert lr_at(60, o, 110) == pytest.approx(at_60)
    assert lr_at(100, o, 110) == pytest.approx(at_100)
    assert lr_at(500, o, 110) == (1.0 if schedule == "constant" else 0.1)
    lrs = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    if schedule == "wsd":
        assert lrs[:80] == [1.0] * 80 and lrs[-1] == 0.1
        short = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd",
                            wsd_decay_fraction=0.5, decay_steps=50)
        assert lr_at(29, short, 110) == 1.0 and lr_at(40, short, 110) == pytest.approx(0.55)


@pytest.mark.slow
def test_a_step_that_evaluates_writes_a_metrics_line(tiny_data, tmp_path):
    """Validation every 3 steps, metrics every 2: the evaluations at steps 3 and 6 are logged
    (with their own lines where the metrics schedule has none)."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.max_steps=6", "log.every=2", "train.eval_every=3"])
    validate(cfg, 1)
    records = build_trainer(cfg, init_runtime(cfg), tmp_path).fit()
    assert [(r["step"], r["val_loss"] is not None) for r in records] == \
        [(2, False), (3, True), (4, False), (6, True)]
