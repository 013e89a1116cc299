"""Zero-bubble pipeline schedules (ZB-H1, ZB-V; Qi et al. 2024): the order against an independent
simulation with unit F, B and W, the rounds, validation before launch, and training equal to
pp=1 on real gloo ranks (with TP + SP, ZeRO 1 and 3, full and partial recompute, fp16, bf16,
edge_stage_layers, and a resume from a 1F1B checkpoint under another layout; zb-v plain, at
pp=4, with TP + SP, ZeRO 1 with overlap_param_gather, ZeRO 3, partial recompute,
edge_stage_layers, fp16, bf16, and checkpoints between it and the other schedules), counting
saved activations in flight."""
from __future__ import annotations

import itertools

import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schedule_rules import expected_bubble
from megalite.config.schema import load_config
from megalite.parallel.schedule import Op, OpKind, max_in_flight, plan_rounds, stage_order

F, B, W = "F", "B", "W"


def _simulate(orders, pp: int, unsplit: bool = False) -> int:
    """Independent reference: every stage runs its next operation as soon as its input is
    there (F: the previous stage's F of that micro-batch done; B: the next stage's B, or with
    `unsplit` its W — an unsplit backward sends its gradient after both halves; W: its own B,
    earlier in the order), one time unit each. Returns the makespan."""
    done, position, t = {}, [0] * pp, 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        ready = []
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            need = {F: (F, s - 1, i) if s > 0 else None,
                    B: (W if unsplit else B, s + 1, i) if s < pp - 1 else None,
                    W: (B, s, i)}[kind]
            if need is None or done.get(need, t + 1) <= t:
                ready.append((kind, s, i))
        assert ready, f"deadlock at {position}"
        for kind, s, i in ready:
            done[(kind, s, i)] = t + 1
            position[s] += 1
        t += 1
    return t


def _orders(pp, m, schedule):
    return [[(op.kind.value, op.micro_batch) for op in stage_order(pp, s, m, 1, schedule)]
            for s in range(pp)]


def _split(order):
    """1F1B's unsplit backward as B then W at once (the same work in unit steps)."""
    return [x for kind, i in order for x in ([(B, i), (W, i)] if kind == B else [(kind, i)])]


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 3, 4, 6], [1, 2, 3, 4, 5, 8, 12])))
def test_zb_h1_order(pp, m):
    """Each stage runs every F, B, W once, W after its B; without the W's it is 1F1B; at most
    min(p, m) micro-batches hold activations (1F1B's peak, stage 0's p) and F..B at most
    p - s as in 1F1B; the simulated makespan gives the schedule's formula."""
    zb = _orders(pp, m, "zb-h1")
    for s, order in enumerate(zb):
        assert sorted(order) == sorted((k, i) for k in (F, B, W) for i in range(m))
        assert all(order.index((B, i)) < order.index((W, i)) for i in range(m))
        assert [x for x in order if x[0] != W] == _orders(pp, m, "1f1b")[s]
        assert max_in_flight(pp, s, m, schedule="zb-h1") <= min(pp, m)
        full = peak = 0
        for kind, _ in order:
            full += {F: 1, B: -1, W: 0}[kind]
            peak = max(peak, full)
        assert peak == min(pp - s, m)
    idle = 1 - 3 * m / _simulate(zb, pp)
    assert idle == pytest.approx(expected_bubble(pp, m, 1, "zb-h1"))


def test_zb_h1_bubble_is_below_1f1b():
    """Unit costs F = B = W (1F1B's backward = B + W) at pp=4, m=8: 1F1B idles
    (p-1)/(m+p-1) = 3/11 of the step, ZB-H1 (p-1)/(3m+p-1) = 3/27."""
    pp, m = 4, 8
    zb = 1 - 3 * m / _simulate(_orders(pp, m, "zb-h1"), pp)
    one = 1 - 3 * m / _simulate([_split(o) for o in _orders(pp, m, "1f1b")], pp, unsplit=True)
    assert one == pytest.approx(expected_bubble(pp, m)) == pytest.approx(3 / 11)
    assert zb == pytest.approx(expected_bubble(pp, m, schedule="zb-h1")) == pytest.approx(3 / 27)
    assert zb < one
    assert expected_bubble(pp, m, 1) == expected_bubble(pp, m, 1, "1f1b")  # positional API


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 2)])
def test_zb_h1_rounds(pp, m):
    """The rounds run each stage's order; every input arrives in an earlier round; W ops
    neither send nor receive; the round count is the simulated makespan."""
    rounds = plan_rounds(pp, m, 1, False, "zb-h1")
    arrived = [set() for _ in range(pp)]
    for index in range(max(r[-1].index for r in rounds) + 1):
        step = [next((r for r in rounds[s] if r.index == index), None) for s in range(pp)]
        for s, rnd in enumerate(step):
            if rnd is None or rnd.op is None:
                continue
            op = rnd.op
            needs = (op.kind == F and s > 0) or (op.kind == B and s < pp - 1)
            if needs:
                assert (op.kind, 0, op.micro_batch) in arrived[s], (s, op)
            if op.kind == W:
                assert all(t.kind != W for t in rnd.sends + rnd.recvs)
        for rnd in step:
            for t in [] if rnd is None else rnd.recvs:
                arrived[t.dst].add((t.kind, t.chunk, t.micro_batch))
    for s in range(pp):
        assert [r.op for r in rounds[s] if r.op is not None] == stage_order(pp, s, m, 1, "zb-h1")
    assert max(r[-1].index for r in rounds) + 1 == _simulate(_orders(pp, m, "zb-h1"), pp)
    assert Op(OpKind.WEIGHT, 0, 0) in stage_order(pp, 0, m, 1, "zb-h1")


def _simulate_v(pp: int, m: int) -> int:
    """Independent reference for ZB-V: rank s holds model slices s (chunk 0) and 2p - 1 - s
    (chunk 1); an F of slice k needs slice k - 1's F of that micro-batch, a B slice k + 1's B, a
    W its own B; one time unit per operation. Returns the makespan."""
    orders = [[(op.kind.value, op.chunk, op.micro_batch)
               for op in stage_order(pp, s, m, 2, "zb-v")] for s in range(pp)]
    slice_of = {(s, c): s if c == 0 else 2 * pp - 1 - s for s in range(pp) for c in (0, 1)}
    done, position, t = {}, [0] * pp, 0
    while any(position[s] < len(orders[s]) for s in range(pp)):
        ready = []
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            kind, c, i = orders[s][position[s]]
            k = slice_of[(s, c)]
            need = {F: (F, k - 1, i) if k > 0 else None,
                    B: (B, k + 1, i) if k < 2 * pp - 1 else None, W: (B, k, i)}[kind]
            if need is None or done.get(need, t + 1) <= t:
                ready.append((kind, k, i, s))
        assert ready, f"deadlock at {position}"
        for kind, k, i, s in ready:
            done[(kind, k, i)] = t + 1
            position[s] += 1
        t += 1
    return t


@pytest.mark.parametrize("pp,m", list(itertools.product([2, 3, 4, 6], [1, 2, 4, 5, 8, 12])))
def test_zb_v_order(pp, m):
    """ZB-V: every chunk's F, B, W once per micro-batch, W
    after its B; at most 2p chunk activations in flight (p micro-batches of a whole stage,
    1F1B's peak); transfers follow the V (the turn from slice p - 1 to slice p stays on rank
    p - 1, a local hand-off, not a send); the rounds take as long as the independent
    simulation, which gives the formula."""
    for s in range(pp):
        order = [(op.kind.value, op.chunk, op.micro_batch) for op in stage_order(pp, s, m, 2, "zb-v")]
        assert sorted(order) == sorted((k, c, i) for k in (F, B, W) for c in (0, 1)
                                       for i in range(m))
        assert all(order.index((B, c, i)) < order.index((W, c, i))
                   for c in (0, 1) for i in range(m))
        assert max_in_flight(pp, s, m, 2, "zb-v") <= 2 * pp
    rounds = plan_rounds(pp, m, 2, False, "zb-v")
    length = max(r[-1].index for r in rounds) + 1
    assert length == _simulate_v(pp, m)
    assert 1 - 6 * m / length == pytest.approx(expected_bubble(pp, m, 2, "zb-v"))
    turn = [t for r in rounds[pp - 1] for t in r.local if t.kind == F]
    assert len(turn) == m and all(t.chunk == 1 for t in turn)  # slice p-1 -> p on one rank
    assert all(t.src != t.dst for rs in rounds for r in rs for t in r.sends + r.recvs)
    if m >= 2 * pp:  # idle (p - 1) chunk units = half of ZB-H1's p - 1 stage units
        assert expected_bubble(pp, m, 2, "zb-v") < expected_bubble(pp, m, 1, "zb-h1")


@pytest.mark.parametrize("overrides,match", [
    (["parallel.schedule=zb-h2"], "parallel.schedule"),
    (["parallel.schedule=interleaved"], "virtual_stages >= 2"),
    (["parallel.schedule=1f1b", "parallel.virtual_stages=2"], "virtual_stages=1"),
    (["parallel.schedule=zb-h1", "parallel.virtual_stages=2"], "virtual_stages=1"),
    (["parallel.schedule=zb-v"], "parallel.virtual_stages=2"),
    (["parallel.schedule=zb-v", "parallel.virtual_stages=3"], "parallel.virtual_stages=2"),
    (["parallel.schedule=zb-v", "parallel.virtual_stages=2", "model.n_layer=3"], "2*pp = 4"),
    (["parallel.schedule=zb-v", "parallel.virtual_stages=2", "train.compile=true"],
     "train.compile=false"),
    (["parallel.schedule=zb-h1", "train.compile=true"], "train.compile=false"),
    (["parallel.schedule=zb-h1", "offload.activations=true"], "offload.activations=false"),
    (["parallel.schedule=zb-h1", "pp=1"], "pp >= 2"),
])
def test_schedule_refused_before_launch(overrides, match):
    cfg = load_config(["device=cpu", "model=tiny", "train.micro_batch_size=4",
                       "train.global_batch_size=16", "pp=2", *overrides])
    with pytest.raises(ConfigError, match=r"parallel\.schedule|" + match) as err:
        validate(cfg, cfg.pp)
    assert match in str(err.value)


def test_schedules_accepted():
    for overrides in (["parallel.schedule=zb-h1"], ["parallel.schedule=1f1b"],
                      ["parallel.schedule=zb-v", "parallel.virtual_stages=2",
                       "train.global_batch_size=12"],  # m = 3: no groups of pp
                      ["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
                      ["parallel.virtual_stages=2"]):
        cfg = load_config(["device=cpu", "model=tiny", "train.micro_batch_size=4",
                           "train.global_batch_size=16", "pp=2", *overrides])
        validate(cfg, 2)


def test_few_micro_batches_warn_with_the_schedules_bubble():
    """m < pp runs (the pipeline cannot fill); the warning gives the schedule's own idle share:
    ZB-H1 at pp=4, m=2: 1 - 6/(2·2 + 2·4 - 1) = 45%, 1F1B: 3/5 = 60%."""
    for schedule, share in (("zb-h1", "45%"), ("1f1b", "60%")):
        cfg = load_config(["device=cpu", "model=tiny", "train.micro_batch_size=4",
                           "train.global_batch_size=8", "pp=4", f"parallel.schedule={schedule}"])
        (warning,) = [w for w in validate(cfg, 4) if "micro-batches" in w]
        assert share in warning and schedule in warning
