"""A Mixtral with the aux loss, the z-loss and the aux-loss-free bias on, at pp=2 under every
schedule (1F1B, interleaved, ZB-H1, ZB-V), equals its serial run with the same micro-batches
accumulated (losses, grad norms, parameters at 1e-5; each MoE layer's step counts, its bias
and the logged figures). Dense first blocks leave a stage (1F1B) or chunks (interleaved, ZB-V)
without an MoE layer: no ledger, no bias, yet their stage logs every layer's figures; the
others' balancing penalties, on stages without the LM head, reach the objective with the
weight the loss has (1 / micro-batches), under a split backward too. The runs take 2 and 4
micro-batches, so a penalty whose weight moved with their number would differ from serial.
At pp=2 x dp=2 (interleaved, ZeRO 1) each stage's bias follows its counts summed over both
replicas. The ZB-V run's checkpoint after step 1 (each stage's biases gathered into meta.json)
resumes at pp=1 and continues the serial run, bias included."""
from __future__ import annotations

import contextlib
from typing import Dict, List

import pytest
import torch

from megalite.model.moe.layer import MoELayer
from megalite.testing.spawn import run_ranks
from tests.conftest import pipeline_layout
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import _many, assert_equal, composed, from_step, train_in_process

STEPS = 3
DENSE = "model.moe.first_dense_layers"
# schedule: (its keys, dense first blocks, micro-batches). 4 blocks at pp=2: 1F1B's stage 0
# holds blocks 0-1 (both dense); the interleaved stage 0 blocks 0 (dense) and 2, stage 1 blocks
# 1 and 3; ZB-V's stage 0 blocks 0 (dense) and 3, stage 1 blocks 1 and 2
SCHEDULES = {
    "1f1b": (["parallel.schedule=1f1b"], 2, 4),
    "interleaved": (["parallel.schedule=interleaved", "parallel.virtual_stages=2"], 1, 2),
    "zb-h1": (["parallel.schedule=zb-h1"], 1, 2),
    "zb-v": (["parallel.schedule=zb-v", "parallel.virtual_stages=2"], 1, 4),
}

pytestmark = pytest.mark.distributed


def _run(tiny_data, pp: int, dense: int, m: int, extra=()) -> List[str]:
    return pipeline_layout(tiny_data, pp, 1, m, [*MOE, f"{DENSE}={dense}", *extra])


@contextlib.contextmanager
def recording_routing(steps: list):
    """Each call of the trainer's `routing_step` appends this rank's MoE layers' step counts
    (before the step's figures are taken) and biases (after the update): ({block: counts},
    {block: bias}). Patched in this process only: the library has no such flag."""
    from megalite.train import trainer

    routing_step = trainer.routing_step

    def recorded(chunks, *args):
        counts, layers = {}, {}
        for chunk in chunks:
            ledger = chunk.routing
            if ledger is not None and ledger.figures is not None:
                counts.update({layer: ledger.figures.counts[row].clone()
                               for row, layer in enumerate(ledger.layers)})
            layers.update({m.index: m for m in chunk.modules() if isinstance(m, MoELayer)})
        out = routing_step(chunks, *args)
        steps.append((counts, {i: m.gate.e_score_correction_bias.clone()
                               for i, m in layers.items()}))
        return out

    trainer.routing_step = recorded
    try:
        yield steps
    finally:
        trainer.routing_step = routing_step


def _recorded_ranks(rank, world, runs, run_dir, steps, save_at):
    with recording_routing([]) as routing:
        results = _many(rank, world, runs, run_dir, steps, save_at)
    for i, res in enumerate(results):
        res["routing"] = routing[i * steps:(i + 1) * steps]
    return results


def _serial(run_dir, overrides, steps=STEPS) -> dict:
    with recording_routing([]) as routing:
        result = train_in_process(run_dir, overrides, steps)
    result["routing"] = routing
    return result


def _merged(ranks: List[dict], step: int):
    """The step's counts and biases of every MoE layer, from the stage that holds it."""
    counts: Dict[int, torch.Tensor] = {}
    biases: Dict[int, torch.Tensor] = {}
    for res in ranks:
        c, b = res["routing"][step]
        assert not set(c) & set(counts) and not set(b) & set(biases)
        counts.update(c)
        biases.update(b)
    return counts, biases


def assert_routing_equal(serial: dict, ranks: List[dict]) -> None:
    for step, (counts, biases) in enumerate(serial["routing"]):
        got_counts, got_biases = _merged(ranks, step)
        assert got_counts.keys() == counts.keys() and got_biases.keys() == biases.keys()
        for layer, expect in counts.items():
            assert torch.equal(got_counts[layer], expect), (step, layer)
        for layer, expect in biases.items():
            torch.testing.assert_close(got_biases[layer], expect, rtol=1e-5, atol=1e-7)


def test_pp2_moe_under_every_schedule_equals_serial_and_resumes_at_pp1(tiny_data, tmp_path):
    serial = {key: _serial(tmp_path / f"serial-{key[0]}-{key[1]}", _run(tiny_data, 1, *key))
              for key in sorted({(dense, m) for _, dense, m in SCHEDULES.values()})}
    ckpt = tmp_path / "ckpt"
    runs = [_run(tiny_data, 2, dense, m, keys + ([f"checkpoint.dir={ckpt}"] if name == "zb-v"
                                                  else []))
            for name, (keys, dense, m) in SCHEDULES.items()]
    results = run_ranks(_recorded_ranks, 2, args=([composed(r) for r in runs], str(tmp_path),
                                                  STEPS, 1), timeout_s=600)
    for i, (name, (_, dense, m)) in enumerate(SCHEDULES.items()):
        ranks = [results[r][i] for r in range(2)]
        reference = serial[(dense, m)]
        assert_equal(reference, ranks)
        assert_figures_equal(reference, ranks)  # every rank logs every stage's layers
        assert_routing_equal(reference, ranks)
        if name == "1f1b":  # stage 0 holds only dense blocks: no counts, no bias
            assert ranks[0]["routing"][0] == ({}, {})
    reference = serial[(1, 4)]
    # pp 2 x dp 2: each stage's bias from its counts summed over its two replicas
    ranks = run_ranks(_recorded_ranks, 4, args=([composed(_run(tiny_data, 2, 1, 4, [
        "parallel.schedule=interleaved", "parallel.virtual_stages=2", "zero=1"]))],
        str(tmp_path / "dp2"), STEPS, None), timeout_s=600)
    ranks = [r[0] for r in ranks]
    assert_equal(reference, ranks)
    assert_figures_equal(reference, ranks)
    for step, (counts, biases) in enumerate(reference["routing"]):
        replicas = [_merged(ranks[r:r + 2], step) for r in (0, 2)]  # rank = pp + 2 dp
        for layer, expect in counts.items():  # the replicas' counts add up to the serial's
            assert torch.equal(replicas[0][0][layer] + replicas[1][0][layer], expect)
        for layer, expect in biases.items():  # and update each replica's bias alike
            for _, got in replicas:
                torch.testing.assert_close(got[layer], expect, rtol=1e-5, atol=1e-7)
    resumed = _serial(tmp_path / "resumed", _run(tiny_data, 1, 1, 4, [
        f"checkpoint.resume={ckpt / 'step_00000001'}"]), STEPS - 1)
    expected = {**from_step(reference, 1), "moe": reference["moe"][1:],
                "routing": reference["routing"][1:]}
    assert_equal(expected, [resumed])
    assert_figures_equal(expected, [resumed])
    assert_routing_equal(expected, [resumed])
