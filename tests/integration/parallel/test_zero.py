"""ZeRO stages 0-3 over the data-parallel dimension, alone and composed with TP and PP.

Gradient integrity and state consistency: every run's losses, grad norms and validation loss
equal the single-process run, and after every step every rank's parameters (gathered from the
shards for zero 3) are its slice of the serial parameters — hence DP replicas are identical.

Memory and traffic, fp32 on CPU: the ZeRO table of `megalite.plan.zero_table` (`model_state_bytes`,
`dp_traffic_elements`; docs/zero.md renders it with `zero_table()`; zero 3's gathers: the plan's
walk of the schedule, `megalite.plan.zero3_gathers`), with Ψ = elements of this
rank's TP x PP shard (vocabulary padded), N = DP size, m = micro-batches per step. For m = 1
these are the ZeRO paper's 2Ψ and 3Ψ; zero 2 and 3 reduce-scatter every micro-batch because
they keep no full gradient to accumulate into.
"""
from __future__ import annotations

import pytest

from megalite.config.layout import Layout
from megalite.parallel.bucket import REDUCTIONS_IN_FLIGHT
from megalite.plan.traffic import stage_traffic
from megalite.plan.zero_table import dp_traffic_elements, model_state_bytes
from megalite.testing.spawn import run_ranks
from tests.conftest import serial_common
from tests.layouts import assert_equal, composed, train_layout, train_layouts

GLOBAL_BATCH = 8
MICRO_BATCH = 2


def _common(tiny_data, extra=()):
    return [f"data.dir={tiny_data}", f"train.micro_batch_size={MICRO_BATCH}",
            f"train.global_batch_size={GLOBAL_BATCH}", *extra]


@pytest.fixture(scope="module")
def serial_run(serial_reference, tiny_data):
    assert serial_common(tiny_data) == _common(tiny_data)  # the run it is the reference of
    return serial_reference


def expected_state_bytes(zero: int, psi: int, n: int) -> dict:
    return model_state_bytes(Layout(dp_size=n, zero_stage=zero), psi, e=4)


def expected_dp_wire_bytes(zero: int, psi: int, n: int, m: int, overrides) -> float:
    """The ZeRO table's bytes; zero 3: the plan's, whose gathers walk the schedule (a unit
    that ends one pipeline operation and starts the next stays gathered: at pp 1 the
    embedding, m - 1 gathers fewer than 3mΨ, `megalite.plan.zero3_gathers`)."""
    if zero == 3:
        cfg = composed(overrides)
        return stage_traffic(cfg, Layout.from_config(cfg, n, "cpu"))[0].comm["dp"]
    return 4 * dp_traffic_elements(Layout(dp_size=n, zero_stage=zero), psi, m)


def dp_wire_bytes(step_comm: dict) -> float:
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith("dp/"))


def _check_accounting(ranks, zero: int, dp: int, m: int, overrides) -> None:
    for res in ranks:
        psi = res["local_numel"]
        for kind, want in expected_state_bytes(zero, psi, dp).items():
            assert res["bytes"][kind] == pytest.approx(want, rel=0.05), (zero, kind, res["bytes"])
        want = expected_dp_wire_bytes(zero, psi, dp, m, overrides)
        assert dp_wire_bytes(res["step_comm"]) == pytest.approx(want, rel=0.05), \
            (zero, res["step_comm"])


@pytest.mark.distributed
@pytest.mark.parametrize("dp", [2, 4])
def test_every_stage_equals_serial(tiny_data, tmp_path, serial_run, dp):
    """zero 0-3 at this DP size, 10 steps each; and the bytes held and sent per rank."""
    m = GLOBAL_BATCH // (MICRO_BATCH * dp)
    configs = [_common(tiny_data, [f"zero={z}"]) for z in range(4)]
    runs = train_layouts(tmp_path, dp, configs)
    for zero, ranks in enumerate(runs):
        assert_equal(serial_run, ranks)
        _check_accounting(ranks, zero, dp, m, configs[zero])


@pytest.mark.distributed
def test_composed_with_tensor_and_pipeline_parallelism(tiny_data, tmp_path, serial_run):
    """tp=2 pp=2 dp=2 (8 ranks) with zero 1 and zero 3 (sequence parallel on for the latter):
    TP-local slices sharded over DP, each stage over its own DP group, the tied embedding's
    copies summed, clipping over one global norm. The zero 3 run once more with activation
    recomputation: the re-run forward inside backward finds its unit gathered and starts no
    gather of its own, so the DP traffic is the same as without recomputation."""
    zero3 = ["tp=2", "pp=2", "zero=3", "sp=true"]
    runs = train_layouts(tmp_path, 8, [
        _common(tiny_data, ["tp=2", "pp=2", "zero=1"]),
        _common(tiny_data, zero3),
        _common(tiny_data, zero3 + ["train.recompute=true"]),
    ])
    for ranks in runs:
        assert_equal(serial_run, ranks)
    for plain, recomputed in zip(runs[1], runs[2]):
        assert dp_wire_bytes(recomputed["step_comm"]) == dp_wire_bytes(plain["step_comm"])


@pytest.mark.distributed
def test_zero3_keeping_gathered_blocks_for_the_step(tiny_data, tmp_path, serial_run):
    """reshard_after_forward=false under PP: the same numbers, one all-gather per unit per step
    instead of two per micro-batch (Ψ + mΨ reduce-scatters)."""
    ranks = train_layout(tmp_path, 4, _common(tiny_data, [
        "pp=2", "zero=3", "parallel.reshard_after_forward=false"]))
    assert_equal(serial_run, ranks)
    m = GLOBAL_BATCH // (MICRO_BATCH * 2)
    for res in ranks:
        want = (1 + m) * (2 - 1) / 2 * 4 * res["local_numel"]
        assert dp_wire_bytes(res["step_comm"]) == pytest.approx(want, rel=0.05)


@pytest.mark.distributed
def test_zero3_gathers_equal_the_plan_under_every_schedule(tiny_data, tmp_path):
    """ZeRO-3's DP bytes per stage equal the plan's walk of the schedule
    (`megalite.plan.zero3_gathers`): interleaved with recomputation, ZB-H1 with the optimizer
    offloaded, ZB-V (its stage 0's head is its embedding), reshard_after_forward=false; pp 2,
    dp 2, m = 4, 2 steps (the runs equal the serial one in tests of their own)."""
    common = [f"data.dir={tiny_data}", "train.micro_batch_size=1", "train.global_batch_size=8",
              "model.n_layer=4", "pp=2", "zero=3"]
    configs = [common + extra for extra in (
        ["parallel.virtual_stages=2", "train.recompute=true"],
        ["parallel.schedule=zb-h1", "offload.optimizer=0.5"],
        ["parallel.schedule=zb-v", "parallel.virtual_stages=2"],
        ["parallel.reshard_after_forward=false"])]
    for overrides, ranks in zip(configs, train_layouts(tmp_path, 4, configs, steps=2)):
        cfg = composed(overrides)
        for stage in stage_traffic(cfg, Layout.from_config(cfg, 4, "cpu")):
            got = [dp_wire_bytes(r["step_comm"]) for r in ranks if r["coords"][1] == stage.stage]
            assert sum(got) / len(got) == pytest.approx(stage.comm["dp"], rel=1e-4), \
                (overrides, stage.stage, got)


@pytest.mark.distributed
def test_small_buckets_and_sizes_that_do_not_divide(tiny_data, tmp_path):
    """Tiny buckets (one per parameter: many reductions during backward) over 3 DP ranks: most
    buckets do not divide by 3 and are padded, not refused; still the serial run. Zero 2 keeps
    at most REDUCTIONS_IN_FLIGHT reduce-scatter inputs alive (under NCCL each pending one holds
    its full-size input), and uses that many."""
    common = _common(tiny_data, ["train.global_batch_size=6", "parallel.bucket_mb=0.01"])
    (serial,) = train_layout(tmp_path / "serial", 1, common, steps=4)
    runs = train_layouts(tmp_path / "dp3", 3, [common + [f"zero={z}"] for z in (1, 2)], steps=4)
    for ranks in runs:
        assert_equal(serial, ranks)
        for res in ranks:  # every bucket padded up to a multiple of 3 elements
            assert res["bytes"]["params"] > 4 * res["local_numel"]
    for res in runs[1]:
        assert res["reductions_in_flight"] == REDUCTIONS_IN_FLIGHT, res["reductions_in_flight"]


@pytest.mark.distributed
def test_overlapped_parameter_gather_equals_serial(tiny_data, tmp_path, serial_run):
    """parallel.overlap_param_gather: zero 1 and zero 2 (many small buckets) at dp 2, and zero 1
    under pp 2: the gathers run during the next forward, and still every step equals the
    serial run, with the same DP traffic."""
    overlap = ["parallel.overlap_param_gather=true", "parallel.bucket_mb=0.05"]
    configs = [_common(tiny_data, ["zero=1", *overlap]), _common(tiny_data, ["zero=2", *overlap])]
    runs = train_layouts(tmp_path, 2, configs)
    m = GLOBAL_BATCH // (MICRO_BATCH * 2)
    for zero, overrides, ranks in zip((1, 2), configs, runs):
        assert_equal(serial_run, ranks)
        _check_accounting(ranks, zero, 2, m, overrides)
    ranks = train_layout(tmp_path / "pp", 4, _common(tiny_data, ["pp=2", "zero=1", *overlap]))
    assert_equal(serial_run, ranks)


def _gather_and_forward_order(rank, world, tiny_data, run_dir):
    """One step, then the next step's order of (wait for bucket b) and (forward of unit u)."""
    from megalite.config.layout import validate
    from megalite.config.schema import load_config
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime
    from tests.conftest import TINY
    from tests.layouts import FP32_NO_DROPOUT

    cfg = load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, [
        "zero=1", "parallel.overlap_param_gather=true", "parallel.bucket_mb=0.05"]))
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    gather = trainer.engine.param_gather
    events = []
    units = trainer.model.chunks[0].sharding_units()
    for u, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, u=u: events.append(("forward", u)))
    trainer.train_step()

    class Recorded:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append(("wait", self.index))
            return self.work.wait()

    index = {id(b): i for i, b in enumerate(gather.order)}
    gather._pending = {k: Recorded(w, index[k]) for k, w in gather._pending.items()}
    events.clear()
    trainer.train_step()
    by_param = {id(p): index[id(b)] for b in gather.order for p in b.params}
    needs = [sorted({by_param[id(p)] for p in unit.parameters()}) for unit in units]
    return events, needs, len(gather.order)


@pytest.mark.distributed
def test_each_block_waits_for_its_own_buckets_only(tiny_data, tmp_path):
    """Each unit's forward comes after the waits for every bucket holding its parameters, and
    the first unit runs before the last bucket has been waited for (the gathers overlap the
    forward instead of all finishing in the step)."""
    for events, needs, n_buckets in run_ranks(_gather_and_forward_order, 2,
                                              args=(tiny_data, str(tmp_path)), timeout_s=300):
        assert n_buckets > 2
        first_forward = {}
        for i, event in enumerate(events):
            if event[0] == "forward":
                first_forward.setdefault(event[1], i)
        waited = {b: i for i, (kind, b) in enumerate(events) if kind == "wait"}
        assert sorted(waited) == list(range(n_buckets))
        for unit, buckets in enumerate(needs):
            assert all(waited[b] < first_forward[unit] for b in buckets), (unit, events)
        assert first_forward[0] < waited[n_buckets - 1], events
