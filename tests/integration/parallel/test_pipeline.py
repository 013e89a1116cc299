"""Pipeline parallelism: the 1F1B and interleaved schedules' orders and rounds, stage
partition, and training equal to pp=1 on real gloo ranks (with tensor parallelism, m < pp,
m = pp and m > pp; interleaved with TP + SP, ZeRO 1 and 3)."""
from __future__ import annotations

import pytest
import torch

from megalite.config.stage_partition import stage_chunks
from megalite.testing.spawn import run_ranks
from tests.conftest import pipeline_layout
from tests.layouts import assert_equal, from_step, train_layout, train_layouts

_layout = pipeline_layout


@pytest.fixture(scope="module")
def serial_runs(pipeline_serial):
    """pp=1 references for every global batch the tests use (shared with test_zero_bubble)."""
    return pipeline_serial


def _check(serial, ranks, pp, v=1):
    assert_equal(serial, ranks)
    for res in ranks:
        stage = res["coords"][1]
        limit = pp - stage if v == 1 else (pp - stage - 1) * 2 + (v - 1) * pp + 1
        assert max(res["in_flight"]) <= limit, (stage, res["in_flight"])


@pytest.mark.distributed
@pytest.mark.parametrize("pp,tp,ms", [
    (2, 1, (1, 6)),  # m < pp, m > pp
    (2, 2, (2,)),  # m = pp
    (4, 1, (4, 2)),  # m = pp, m < pp
    (4, 2, (6,)),  # m > pp, 8 ranks
])
def test_training_equals_pp1(tiny_data, tmp_path, serial_runs, pp, tp, ms):
    """10 optimizer steps (fp32, dropout 0): losses, grad norms, validation loss and every
    parameter slice after every step equal the pp=1 run within 1e-5 relative; activations of
    at most pp - stage micro-batches alive at once on each stage."""
    runs = train_layouts(tmp_path, pp * tp, [_layout(tiny_data, pp, tp, m) for m in ms])
    for m, ranks in zip(ms, runs):
        _check(serial_runs[m], ranks, pp)


@pytest.mark.distributed
def test_tied_embedding_copies_stay_identical(tiny_data, tmp_path, serial_runs):
    """The first stage's token embedding and the last stage's LM-head copy start equal, get
    the same (summed) gradient and stay equal, step after step; with sequence parallelism and
    uneven stages too."""
    ranks = train_layout(tmp_path, 4, _layout(tiny_data, 2, 2, 4, ["sp=true"]))
    _check(serial_runs[4], ranks, 2)
    by_coords = {r["coords"]: r for r in ranks}
    for tp_rank in range(2):
        first, last = by_coords[(tp_rank, 0, 0)], by_coords[(tp_rank, 1, 0)]
        for step in range(len(first["params"])):
            assert torch.equal(first["params"][step]["models.0.transformer.wte.weight"],
                               last["params"][step]["models.0.lm_head.weight"])


@pytest.mark.distributed
def test_edge_stages_with_fewer_blocks(tiny_data, tmp_path, serial_runs):
    ranks = train_layout(tmp_path, 3, _layout(tiny_data, 3, 1, 4,
                                              ["parallel.edge_stage_layers=1"]))
    _check(serial_runs[4], ranks, 3)
    blocks = {r["coords"][1]: sorted({s.name.split(".")[2] for s in r["specs"].values()
                                      if s.name.startswith("transformer.h.")}) for r in ranks}
    assert blocks == {0: ["0"], 1: ["1", "2"], 2: ["3"]}


@pytest.mark.distributed
@pytest.mark.parametrize("pp,tp,m,extra", [
    (2, 1, 2, []),  # m = pp: every forward of both chunks is warmup on stage 0
    (2, 2, 4, ["sp=true"]),  # with TP + SP
    (4, 1, 4, []),  # 8 chunks of one block each (n_layer=8)
])
def test_interleaved_training_equals_pp1(tiny_data, tmp_path, serial_runs, pp, tp, m, extra):
    """Interleaved 1F1B (virtual_stages=2): the same 10 steps as the pp=1 run, every
    parameter slice included; activations alive stay within Megatron's warmup + 1."""
    overrides = _layout(tiny_data, pp, tp, m, ["parallel.virtual_stages=2", *extra])
    if pp * 2 > 4:
        overrides.append("model.n_layer=8")
        serial = train_layout(tmp_path / "serial", 1, _layout(tiny_data, 1, 1, m,
                                                               ["model.n_layer=8"]))[0]
    else:
        serial = serial_runs[m]
    _check(serial, train_layout(tmp_path, pp * tp, overrides), pp, v=2)


@pytest.mark.distributed
def test_interleaved_with_zero_and_resharded_resume(tiny_data, tmp_path, serial_runs):
    """pp2 x dp2 with virtual_stages=2 under zero 3 equals the pp=1 run; its step-5 checkpoint
    resumes under (pp2, v2, zero 1), (pp2, v2, zero 2) and (pp4, v1): steps 6-10 equal the
    uninterrupted run (block names are global, so chunks do not show in the checkpoint)."""
    root = tmp_path / "ckpt"
    writer = _layout(tiny_data, 2, 1, 4, ["parallel.virtual_stages=2", "zero=3",
                                          f"checkpoint.dir={root}"])
    (written,) = train_layouts(tmp_path / "w", 4, [writer], save_at=5)
    _check(serial_runs[4], written, 2, v=2)
    serial = serial_runs[4]
    expected = from_step(serial, 5)
    resume = f"checkpoint.resume={root / 'step_00000005'}"
    for ranks in train_layouts(tmp_path / "r", 4, [
            _layout(tiny_data, 2, 1, 4, ["parallel.virtual_stages=2", "zero=1", resume]),
            _layout(tiny_data, 2, 1, 4, ["parallel.virtual_stages=2", "zero=2", resume]),
            _layout(tiny_data, 4, 1, 4, [resume])], steps=5):
        assert_equal(expected, ranks)


SLOW_S = 0.4


def _slow_middle_stage(rank, world, m):
    """pp=3 (1F1B, tiny chunks) with stage 1's forwards held up SLOW_S each; returns this
    stage's F/B events of the second step."""
    import time

    from megalite.config.layout import Layout
    from megalite.config.schema import ModelConfig, OptimConfig
    from megalite.model.init import init_parameters
    from megalite.model.stage import build_stage
    from megalite.parallel.pipeline import PipelineSchedule
    from megalite.parallel.topology import build_topology
    from megalite.parallel.zero import ZeroEngine

    topo = build_topology(1, world, 1)
    cfg = ModelConfig(n_layer=world, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = build_stage(cfg, stage_chunks(world, world)[rank], rank, world,
                        tp_group=topo.tp_group)
    for chunk in model.chunks:
        init_parameters(chunk, seed=0)
        if rank == 1:
            fast = chunk.forward

            def slow(*args, fast=fast):
                time.sleep(SLOW_S)
                return fast(*args)

            chunk.forward = slow
    engine = ZeroEngine(model, topo, Layout.of(topo), OptimConfig())
    schedule = PipelineSchedule(model.chunks, topo, engine, (16, 2, 32), torch.float32,
                                torch.device("cpu"))
    w = torch.randint(0, 64, (m, 2, 17), generator=torch.Generator().manual_seed(0))
    batches = [(x[:, :-1], x[:, 1:]) for x in w]
    for _ in range(2):
        schedule.train_step(batches)
        engine.finish_grad_sync()
        engine.zero_grad()
    return [(e.kind, e.micro_batch, e.start, e.end) for e in schedule.trace.events]


@pytest.mark.distributed
def test_a_stage_does_not_wait_for_its_sends():
    """Stage 0 of pp=3 runs F0 F1 F2 before its first backward (1F1B warmup) and F2 needs
    nothing from the other stages. Stage 1 receives F1's activation only after its own slow
    forward of micro-batch 0: a stage that waited for its sends (lockstep rounds) would start
    F2 about SLOW_S after F1 ended; posted without waiting, F2 follows F1 at once."""
    events = run_ranks(_slow_middle_stage, 3, args=(3,), timeout_s=300)[0]
    at = {(kind, mb): (start, end) for kind, mb, start, end in events}
    assert [k for k, _, _, _ in events[:3]] == ["F", "F", "F"]
    gap = at[("F", 2)][0] - at[("F", 1)][1]
    assert gap < SLOW_S / 4, gap
