"""Pipeline parallelism: the 1F1B and interleaved schedules' orders and rounds, stage
partition, and training equal to pp=1 on real gloo ranks (with tensor parallelism, m < pp,
m = pp and m > pp; interleaved with TP + SP, ZeRO 1 and 3)."""
from __future__ import annotations

import itertools

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.config.stage_partition import partition_layers, stage_chunks
from megalite.parallel.pipeline import Event, StepTrace
from megalite.parallel.schedule import Op, OpKind, max_in_flight, peak_live_bytes, plan_rounds, stage_order
from megalite.testing.spawn import run_ranks
from tests.conftest import pipeline_layout
from tests.layouts import assert_equal, from_step, train_layout, train_layouts


def _simulate_1f1b(pp: int, m: int):
    """Independent reference: event-driven simulation of PipeDream-Flush with unit-time F and
    B. A stage runs a backward whenever one is ready (gradient arrived), else a forward if
    fewer than pp - stage micro-batches are in flight and its input arrived."""
    done_f = [[None] * m for _ in range(pp)]  # time each F finished
    done_b = [[None] * m for _ in range(pp)]
    orders = [[] for _ in range(pp)]
    nf, nb, t = [0] * pp, [0] * pp, 0
    while any(nb[s] < m for s in range(pp)):
        ops = []
        for s in range(pp):
            i = nb[s]
            can_b = i < nf[s] and (s == pp - 1 or (done_b[s + 1][i] is not None
                                                    and done_b[s + 1][i] <= t))
            j = nf[s]
            can_f = j < m and nf[s] - nb[s] < pp - s and (
                s == 0 or (done_f[s - 1][j] is not None and done_f[s - 1][j] <= t))
            if can_b:
                ops.append((s, "B", i))
            elif can_f:
                ops.append((s, "F", j))
        for s, kind, i in ops:
            orders[s].append((kind, i))
            if kind == "F":
                done_f[s][i], nf[s] = t + 1, nf[s] + 1
            else:
                done_b[s][i], nb[s] = t + 1, nb[s] + 1
        t += 1
    return orders


@pytest.mark.parametrize("pp,m", list(itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 5, 8])))
def test_schedule_is_1f1b(pp, m):
    reference = _simulate_1f1b(pp, m)
    for stage in range(pp):
        order = [(op.kind, op.micro_batch) for op in stage_order(pp, stage, m)]
        assert order == reference[stage], (stage, order, reference[stage])
        warmup = min(pp - stage - 1, m)
        assert order[:warmup] == [("F", i) for i in range(warmup)]
        assert max_in_flight(pp, stage, m) == min(pp - stage, m)


def test_interleaved_order_is_megatrons():
    """pp=2, v=2, m=4 (Megatron's get_model_chunk_id / warmup count): forwards go through the
    micro-batches in groups of pp per chunk, backwards with the chunks reversed."""
    f = [Op("F", c, i) for c, i in [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]]
    b = [Op("B", c, i) for c, i in [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]]
    # stage 0: warmup (2-0-1)*2 + (2-1)*2 = 4 forwards; stage 1: 2
    assert stage_order(2, 0, 4, 2) == f[:4] + [f[4], b[0], f[5], b[1], f[6], b[2], f[7], b[3]] \
        + b[4:]
    assert stage_order(2, 1, 4, 2) == f[:2] + [x for k in range(6) for x in (f[2 + k], b[k])] \
        + b[6:]
    with pytest.raises(ValueError, match="multiple of pp=2"):
        stage_order(2, 0, 3, 2)


@pytest.mark.parametrize("pp,v", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 1), (4, 2), (4, 4), (8, 2)])
def test_rounds_match_and_bubble_follows_the_formula(pp, v):
    """Every operation runs once, after its input arrived; every transfer is one stage's send
    and its consumer's receive in the same round; the simulated idle fraction is
    (p-1)/(v·m+p-1) and at most (p-s-1)·2 + (v-1)·p + 1 chunk activations are alive (Megatron's
    warmup + 1)."""
    for m in (pp, 2 * pp, 3 * pp) if v > 1 else (1, pp - 1 or 1, pp, 2 * pp + 1):
        rounds = plan_rounds(pp, m, v)
        arrived, sent, received = [set() for _ in range(pp)], [], []
        for index in range(max(r[-1].index for r in rounds) + 1):
            for s in range(pp):
                rnd = next((r for r in rounds[s] if r.index == index), None)
                if rnd is None:
                    continue
                op = rnd.op
                if op is not None:
                    virtual = op.chunk * pp + s
                    needs_input = (op.kind == "F" and virtual > 0) or \
                        (op.kind == "B" and virtual < pp * v - 1)
                    if needs_input:
                        assert (op.kind, op.chunk, op.micro_batch) in arrived[s], (s, op)
                sent += [(index, t) for t in rnd.sends]
                received += [(index, t) for t in rnd.recvs]
                assert all(t.src == s for t in rnd.sends) and all(t.dst == s for t in rnd.recvs)
            for i, t in received:
                if i == index:
                    arrived[t.dst].add((t.kind, t.chunk, t.micro_batch))
        assert sorted(sent, key=repr) == sorted(received, key=repr)
        for s in range(pp):
            ops = [r.op for r in rounds[s] if r.op is not None]
            assert sorted(ops, key=repr) == sorted(
                (Op(k, c, i) for k in (OpKind.FORWARD, OpKind.BACKWARD) for c in range(v)
                 for i in range(m)), key=repr)
            assert ops == stage_order(pp, s, m, v)
            limit = min(pp - s, m) if v == 1 else min((pp - s - 1) * 2 + (v - 1) * pp + 1, m * v)
            assert max_in_flight(pp, s, m, v) == limit
        length = max(r[-1].index for r in rounds) + 1  # in forward/backward time units
        assert 1 - 2 * m * v / length == pytest.approx(expected_bubble(pp, m, v))


def test_peak_live_bytes_weights_the_chunks():
    assert peak_live_bytes(2, 0, 4, 2, [1.0, 1.0]) == max_in_flight(2, 0, 4, 2)
    # stage 0: F(0,0) F(0,1) F(1,0) F(1,1) F(0,2) B(1,0) F(0,3): 4 x 10 + 1 alive
    assert peak_live_bytes(2, 0, 4, 2, [10.0, 1.0]) == 41.0


def test_stage_chunks_interleave_the_model():
    assert stage_chunks(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert stage_chunks(8, 2) == [[range(0, 4)], [range(4, 8)]]
    assert [[len(r) for r in c] for c in stage_chunks(10, 2, 2, edge_stage_layers=2)] == \
        [[2, 3], [3, 2]]


@pytest.mark.parametrize("overrides,key", [
    (["pp=1", "parallel.virtual_stages=2"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=0"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=2", "model.n_layer=3"], "parallel.virtual_stages"),
    (["pp=2", "parallel.virtual_stages=2", "train.global_batch_size=12"],
     "train.global_batch_size"),  # m = 3
    (["pp=2", "parallel.virtual_stages=2", "model.n_layer=4",
      "parallel.edge_stage_layers=2"], "parallel.edge_stage_layers"),
])
def test_virtual_stages_refused_before_launch(overrides, key):
    cfg = load_config(["device=cpu", "model=tiny", "train.micro_batch_size=4",
                       "train.global_batch_size=16", *overrides])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 2 if "pp=2" in overrides else 1)


def test_partition_is_contiguous_and_balanced():
    assert partition_layers(12, 1) == [range(0, 12)]
    assert partition_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    # the remainder goes to the middle stages first (the edges hold embedding and head)
    assert [len(r) for r in partition_layers(14, 4)] == [3, 4, 4, 3]
    assert [len(r) for r in partition_layers(48, 5)] == [9, 10, 10, 10, 9]
    # an explicit, smaller edge
    assert [len(r) for r in partition_layers(12, 4, edge_stage_layers=2)] == [2, 4, 4, 2]
    assert [len(r) for r in partition_layers(13, 5, edge_stage_layers=2)] == [2, 3, 3, 3, 2]
    with pytest.raises(ValueError, match="pp=5"):
        partition_layers(4, 5)
    with pytest.raises(ValueError, match="edge_stage_layers=3"):
        partition_layers(6, 3, edge_stage_layers=3)


def test_bubble_of_a_trace():
    trace = StepTrace([Event("F", 0, 0.0, 1.0), Event("B", 0, 3.0, 5.0)], wall=6.0)
    assert trace.busy == 3.0 and 1 - trace.busy / trace.wall == 0.5
    assert expected_bubble(4, 4) == pytest.approx(3 / 7)


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
