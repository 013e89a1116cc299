"""Zero-bubble pipeline schedules (ZB-H1, ZB-V; Qi et al. 2024): the order against an independent
simulation with unit F, B and W, the rounds, validation before launch, and training equal to
pp=1 on real gloo ranks (with TP + SP, ZeRO 1 and 3, full and partial recompute, fp16, bf16,
edge_stage_layers, and a resume from a 1F1B checkpoint under another layout; zb-v plain, at
pp=4, with TP + SP, ZeRO 1 with overlap_param_gather, ZeRO 3, partial recompute,
edge_stage_layers, fp16, bf16, and checkpoints between it and the other schedules), counting
saved activations in flight."""
from __future__ import annotations

import weakref

import pytest
import torch

from megalite.parallel.schedule import OpKind, max_in_flight
from megalite.testing.spawn import run_ranks
from tests.conftest import BF16_LEARNING, EIGHT_BLOCKS, FP16_LEARNING, pipeline_layout
from tests.integration.train.test_mixed_precision import TOLERANCE
from tests.layouts import (
    PER_STEP,
    _many,
    assert_equal,
    from_step,
    master_update_error,
)

ZB = "parallel.schedule=zb-h1"
ZV = ("parallel.schedule=zb-v", "parallel.virtual_stages=2")


def _layout(tiny_data, pp, m, extra=()):
    return pipeline_layout(tiny_data, pp, 1, m, extra)


def _count_saved_activations(peaks: list) -> None:
    """Patch the executor (in this rank's process) to count, after each operation, the
    (chunk, micro-batch) pairs whose forward saved a floating-point activation that is still
    alive (weak references to what autograd's saved-tensor hooks pack; parameters excluded),
    appending each step's (peak, the kinds of operation its trace shows) to `peaks`."""
    from megalite.parallel import pipeline

    operate, train_step = pipeline.PipelineSchedule._operate, pipeline.PipelineSchedule.train_step
    saved: dict = {}
    peak = [0]

    def counted(self, op, run):
        key = (op.chunk, op.micro_batch)
        if op.kind is not OpKind.FORWARD or not run.training:
            out = operate(self, op, run)
        else:
            def pack(t):
                if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
                    saved.setdefault(key, []).append(weakref.ref(t))
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = operate(self, op, run)
        live = sum(any(r() is not None for r in refs) for refs in saved.values())
        peak[0] = max(peak[0], live)
        return out

    def step(self, *args, **kwargs):
        saved.clear()
        peak[0] = 0
        loss = train_step(self, *args, **kwargs)
        peaks.append((peak[0], "".join(sorted({e.kind.value for e in self.trace.events}))))
        return loss

    pipeline.PipelineSchedule._operate = counted
    pipeline.PipelineSchedule.train_step = step


def _ranks_counting(rank, world, runs, run_dir, steps, save_at):
    peaks: list = []
    _count_saved_activations(peaks)
    results = _many(rank, world, runs, run_dir, steps, save_at)
    per_run = len(peaks) // len(runs)
    for i, res in enumerate(results):
        steps_of_run = peaks[i * per_run:(i + 1) * per_run]
        res["saved_in_flight"] = [p for p, _ in steps_of_run]
        res["traced"] = {kinds for _, kinds in steps_of_run}
    return results


def _train(tmp_path, world, runs, steps=10, save_at=None):
    per_rank = run_ranks(_ranks_counting, world, args=(runs, str(tmp_path), steps, save_at),
                         timeout_s=900)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]


def _check(ref, ranks, pp, m, counted=True):
    """Equal to the serial run; saved activations of at most min(pp, m) micro-batches alive
    (1F1B's peak), as many as the schedule says on each stage."""
    assert_equal(ref, ranks)
    for res in ranks:
        stage = res["coords"][1]
        bound = max_in_flight(pp, stage, m, schedule="zb-h1")
        assert bound <= min(pp, m)
        assert max(res["in_flight"]) == bound, (stage, res["in_flight"])
        assert res["traced"] == {"BFW"}  # the pipeline trace shows F, B and W
        if counted:
            assert max(res["saved_in_flight"]) == bound, (stage, res["saved_in_flight"])


def _check_v(ref, ranks, pp, m):
    """zb-v equal to the serial run; each stage holds at most the (chunk, micro-batch)
    activations its order says (counted from the saved tensors), at most 2p."""
    assert_equal(ref, ranks)
    for res in ranks:
        bound = max_in_flight(pp, res["coords"][1], m, 2, "zb-v")
        assert bound <= 2 * pp
        assert max(res["in_flight"]) == bound, res["in_flight"]
        assert res["traced"] == {"BFW"}
        assert max(res["saved_in_flight"]) == bound, res["saved_in_flight"]


def _check_bf16(serial: dict, runs: list) -> None:
    """bf16 runs within test_mixed_precision's tolerances of the bf16 serial run."""
    tol = TOLERANCE["bf16"]
    for res in runs:
        assert all(p.dtype == torch.bfloat16 for p in res["params"][0].values())
        for s in range(10):
            assert abs(res["losses"][s] / serial["losses"][s] - 1) < tol["loss"], s
            assert abs(res["norms"][s] / serial["norms"][s] - 1) < tol["norm"], s
        assert master_update_error(serial, res) < tol["master"]


def _first_steps(result: dict, steps: int) -> dict:
    return {**result, **{key: result[key][:steps] for key in PER_STEP}}


@pytest.mark.distributed
def test_zb_h1_training_equals_pp1(tiny_data, tmp_path, pipeline_serial):
    """10 steps (fp32, dropout 0) equal to the pp=1 run — losses, grad norms, validation loss,
    every parameter slice after every step — for zb-h1 at pp=2 and 4 with m = pp and 2·pp
    (pp=2 with full, then partial recompute), tp2 + SP, zero 3 (dp2); fp16 and bf16 within the
    mixed-precision tolerances of the serial run of that precision. A 1F1B (pp=2, dp1)
    checkpoint of step 5 resumed under zb-h1 with pp=2, dp2, zero 1 and overlap_param_gather
    gives the serial steps 6-10. The pipeline trace shows F, B and W. zb-v (pp=2: stage 0 holds
    the embedding and the LM head as one parameter) equals the serial run plain, with tp2 + SP,
    fp16 with full recompute and bf16 (tolerances), and resumed from the 1F1B checkpoint under
    dp2 + zero 3; its own checkpoint resumes under zb-h1, dp2, zero 2. With 8 blocks (against
    the 8-block serial run): zb-h1 at pp=4 with edge_stage_layers=1 (1-3-3-1), zb-v at pp=2
    with edge_stage_layers=3 (slices 3-1-1-3) and partial recompute, zb-v at pp=2 dp2 with
    zero 1, overlap_param_gather and partial recompute, and zb-v at pp=4 with m = 4 and 8."""
    serial, ckpt, ckpt_v = pipeline_serial, tmp_path / "ckpt", tmp_path / "ckpt_v"
    two = [_layout(tiny_data, 2, 2, [ZB, "train.recompute=true"]),
           _layout(tiny_data, 2, 4, [ZB, "train.recompute=true", "train.recompute_layers=1"]),
           _layout(tiny_data, 2, 2, [ZB, *FP16_LEARNING]),
           _layout(tiny_data, 2, 4, ["parallel.schedule=1f1b", f"checkpoint.dir={ckpt}"]),
           _layout(tiny_data, 2, 4, [*ZV, f"checkpoint.dir={ckpt_v}"]),
           _layout(tiny_data, 2, 2, [*ZV, *FP16_LEARNING, "train.recompute=true"]),
           _layout(tiny_data, 2, 2, [ZB, *BF16_LEARNING]),
           _layout(tiny_data, 2, 2, [*ZV, *BF16_LEARNING]),
           _layout(tiny_data, 2, 4, [*ZV, *EIGHT_BLOCKS, "parallel.edge_stage_layers=3",
                                     "train.recompute=true", "train.recompute_layers=2"])]
    full, partial, fp16, writer, zb_v, v_fp16, bf16, v_bf16, v_edge = _train(
        tmp_path / "two", 2, two, save_at=5)
    _check(serial[2], full, 2, 2, counted=False)  # recompute: checkpoint's own saved hooks
    _check(serial[4], partial, 2, 4, counted=False)
    assert_equal(serial[4], writer)
    _check_v(serial[4], zb_v, 2, 4)
    for res in fp16 + v_fp16:  # (zb-v: with full recompute, which changes no value)
        assert all(p.dtype == torch.float16 for p in res["params"][0].values())
        for s in range(10):
            assert abs(res["losses"][s] / serial["fp16"]["losses"][s] - 1) < 3e-3, s
        assert master_update_error(serial["fp16"], res) < 0.2
    _check_bf16(serial["bf16"], bf16 + v_bf16)
    assert_equal(serial["n8"], v_edge)
    resume = f"checkpoint.resume={ckpt / 'step_00000005'}"
    four = [_layout(tiny_data, 4, 4, [ZB]), _layout(tiny_data, 4, 8, [ZB]),
            pipeline_layout(tiny_data, 2, 2, 4, [ZB, "sp=true"]),
            _layout(tiny_data, 2, 4, [ZB, "zero=3"]),
            _layout(tiny_data, 2, 4, [ZB, "zero=1", "parallel.overlap_param_gather=true",
                                      resume]),
            pipeline_layout(tiny_data, 2, 2, 2, [*ZV, "sp=true"]),
            _layout(tiny_data, 2, 4, [*ZV, "zero=3", resume]),
            _layout(tiny_data, 2, 4, [ZB, "zero=2", f"checkpoint.resume={ckpt_v / 'step_00000005'}"]),
            _layout(tiny_data, 4, 4, [ZB, *EIGHT_BLOCKS, "parallel.edge_stage_layers=1"]),
            _layout(tiny_data, 2, 4, [*ZV, *EIGHT_BLOCKS, "zero=1",
                                      "parallel.overlap_param_gather=true",
                                      "train.recompute=true", "train.recompute_layers=1"]),
            _layout(tiny_data, 4, 4, [*ZV, *EIGHT_BLOCKS]),
            _layout(tiny_data, 4, 8, [*ZV, *EIGHT_BLOCKS])]
    (pp4, pp4_m8, tp_sp, zero3, resumed, v_tp_sp, v_resumed, from_v, edge, v_zero1,
     v_pp4, v_pp4_m8) = _train(tmp_path / "four", 4, four)
    _check(serial[4], pp4, 4, 4)
    _check(serial[8], pp4_m8, 4, 8)
    for ranks in (tp_sp, zero3):
        assert_equal(serial[4], ranks)
    _check_v(serial[2], v_tp_sp, 2, 2)
    _check(serial["n8"], edge, 4, 4)
    assert_equal(serial["n8"], v_zero1)
    _check_v(serial["n8"], v_pp4, 4, 4)
    _check_v(serial["n8m8"], v_pp4_m8, 4, 8)
    expected = from_step(serial[4], 5)
    for res in resumed + v_resumed + from_v:  # the 5 steps after the resume (val: after 10)
        assert_equal({**expected, "val": res["val"]}, [_first_steps(res, 5)])
