"""Every layout class with every default on, run as `pretrain.py` runs it.

The parity tests step trainers directly; a run goes through `Trainer.fit()`, where the
default-on services act: the replica check (`resilience.check_every`, and before every
checkpoint), the straggler report (`resilience.straggler_report_every`), the hang watch
(`resilience.hang_dump`) and the validation loss (`train.eval_every`). Here each layout class
is built by `build_trainer` and trained by `fit()` with those defaults on (their periods
lowered into the run, not switched off) through a checkpoint step, a replica check and the
last step (steps 1-3), then resumed once from that last checkpoint (steps 4-5): its losses
and grad norms, read from `fit()`'s records, must equal the serial run's (the pipeline tests'
8-block reference), and the validation losses (steps 2-5) every other layout's of the same
spawn. Layouts share spawns by world size (2, 4 and 8 ranks).
"""
from __future__ import annotations

import pytest

from megalite.config.layout import validate
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import EIGHT_BLOCKS, pipeline_layout
from tests.layouts import close, composed

pytestmark = pytest.mark.distributed

FIRST, LAST = 3, 5  # steps before the resume, steps in all
# the defaults on, their periods inside the run: a checkpoint at step 2 (replica-checked
# first) and at every run's last step, replica checks and straggler reports every 2 steps
DEFAULTS_IN_RUN = ["checkpoint.every=2", "resilience.check_every=2",
                   "resilience.straggler_report_every=2", "train.eval_every=2", "train.eval_steps=1"]

WORLD_2 = {
    "tp2": ["tp=2"],
    "tp2 sp": ["tp=2", "sp=true"],
    "pp2 1f1b": ["pp=2"],
    "pp2 interleaved v2": ["pp=2", "parallel.virtual_stages=2"],
    "pp2 zb-h1": ["pp=2", "parallel.schedule=zb-h1"],
    "pp2 zb-v": ["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2"],
    "dp2 zero0": ["zero=0"],
    "dp2 zero1": ["zero=1"],
    "dp2 zero2": ["zero=2"],
    "dp2 zero3": ["zero=3"],
    "dp2 zero1 optimizer offload": ["zero=1", "offload.optimizer=1"],
    "pp2 activation offload": ["pp=2", "offload.activations=true"],
}
WORLD_4 = {
    "pp4 1f1b": ["pp=4"],
    "pp4 zb-h1": ["pp=4", "parallel.schedule=zb-h1"],
    "pp4 zb-v": ["pp=4", "parallel.schedule=zb-v", "parallel.virtual_stages=2"],
    "pp4 interleaved v2": ["pp=4", "parallel.virtual_stages=2"],
    "pp4 zb-v optimizer offload": ["pp=4", "parallel.schedule=zb-v", "parallel.virtual_stages=2",
                                   "offload.optimizer=0.5"],
    "pp4 activation offload first 1": ["pp=4", "offload.activations=true",
                                       "offload.activations_layers=1"],
}
WORLD_8 = {
    "tp2 sp pp2 dp2 zero1": ["tp=2", "sp=true", "pp=2", "zero=1"],
}


def _configs(tiny_data, tmp, extra):
    """(first part, resumed part) of one layout: the serial reference's model and batch
    (8 blocks, micro-batch 1, 4 sequences a step)."""
    base = pipeline_layout(tiny_data, 1, 1, 4, [*EIGHT_BLOCKS, *DEFAULTS_IN_RUN, *extra,
                                                f"checkpoint.dir={tmp}/checkpoints"])
    return (composed([*base, f"train.max_steps={FIRST}"]),
            composed([*base, f"train.max_steps={LAST}", "checkpoint.resume=auto"]))


def _fit(world, cfg, run_dir):
    """One run the way `pretrain.py` makes it: validated, built, trained by `fit()`."""
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    records = trainer.fit()
    services = {"replica_checks": trainer.replicas.checks,
                "straggler_reports": sum("straggler_report" in r for r in records),  # rank 0
                "last_straggler_report": trainer.stragglers.window_start,  # every rank
                "hang_watch": trainer.hang_watch is not None,
                "start": records[0]["step"] - 1}
    return records, services


def _fit_and_resume(rank, world, parts, run_dir):
    out = []
    for i, (first, resumed) in enumerate(parts):
        a, services_a = _fit(world, first, f"{run_dir}/{i}")
        b, services_b = _fit(world, resumed, f"{run_dir}/{i}")
        out.append({"losses": [r["loss"] for r in a + b], "norms": [r["grad_norm"] for r in a + b],
                    "steps": [r["step"] for r in a + b], "services": (services_a, services_b),
                    "val": [r["val_loss"] for r in a + b]})
    return out


def _run(tiny_data, tmp_path, world, layouts):
    parts = [_configs(tiny_data, tmp_path / str(i), extra) for i, extra in enumerate(layouts.values())]
    per_rank = run_ranks(_fit_and_resume, world, args=(parts, str(tmp_path)), timeout_s=600)
    return {name: [per_rank[r][i] for r in range(world)] for i, name in enumerate(layouts)}


def _assert_matches_serial(serial, name, ranks):
    for r, res in enumerate(ranks):
        assert res["steps"] == list(range(1, LAST + 1)), (name, r, res["steps"])
        for s in range(LAST):
            assert close(serial["losses"][s], res["losses"][s], 1e-5), \
                (name, r, s, serial["losses"][s], res["losses"][s])
            assert close(serial["norms"][s], res["norms"][s], 1e-5), \
                (name, r, s, serial["norms"][s], res["norms"][s])
        first, resumed = res["services"]
        assert resumed["start"] == FIRST, (name, r, resumed)
        # checked at step 2 (due, and its checkpoint) and 3 (the last step's checkpoint); then
        # at 4 and 5: every rank, middle stages of pp >= 3 included, took part in each
        assert (first["replica_checks"], resumed["replica_checks"]) == (2, 2), (name, r, res)
        assert (first["last_straggler_report"], resumed["last_straggler_report"]) == (2, 4), \
            (name, r, res)
        assert (first["straggler_reports"], resumed["straggler_reports"]) == \
            ((1, 1) if r == 0 else (0, 0)), (name, r, res)
        assert first["hang_watch"] and resumed["hang_watch"], (name, r)


@pytest.mark.parametrize("world,layouts", [(2, WORLD_2), (4, WORLD_4), (8, WORLD_8)],
                         ids=["world2", "world4", "world8"])
def test_every_layout_class_with_the_defaults_on_equals_serial(tiny_data, tmp_path, pipeline_serial,
                                                               world, layouts):
    serial = pipeline_serial["n8"]
    results = _run(tiny_data, tmp_path, world, layouts)
    val = results[next(iter(results))][0]["val"]
    assert val[0] is None and all(v is not None for v in val[1:]), val  # steps 2 (due), 3 (end), ...
    for name, ranks in results.items():
        _assert_matches_serial(serial, name, ranks)
        for r, res in enumerate(ranks):
            assert all(a is b is None or close(a, b, 1e-5) for a, b in zip(val, res["val"])), \
                (name, r, val, res["val"])
