"""Hang dumps (megalite.resilience.flight / hang / hang_report): a rank that stops
participating makes its peer's collective time out; every rank writes its stacks and last
collectives, and the summary names the missing rank and the group. A signal dumps a live run."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch.distributed as dist

from megalite.config.errors import ConfigError
from megalite.config.schema import check_sections, load_config
from megalite.parallel.group import Group, single_rank_group
from megalite.resilience.flight import (
    ARRIVAL,
    ENDED_AT,
    ERROR,
    FAILED,
    PROBE,
    STARTED_AT,
    STUCK,
    FlightRecorder,
)
from megalite.resilience.hang import HangWatch
from megalite.resilience.hang_report import load_dumps, summarize


def wait_for(predicate, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _group(name, ranks, rank):
    return Group(name=name, ranks=ranks, rank=rank, pg=None,
                 counter=single_rank_group(name).counter)


def test_the_recorder_keeps_the_last_collectives_per_group_with_their_numbers():
    rec = FlightRecorder(rank=0, history=3)
    tp, pp = _group("tp", [0, 1], 0), _group("pp", [0, 2], 0)
    for _ in range(5):
        rec.done(rec.started("all_reduce", tp, 64))
    pending = rec.started("all_gather", tp, 128)
    rec.waiting(pending)
    rec.started("send/recv", pp, 32, peers=[2])
    snap = {g["group"]: g for g in rec.snapshot()}
    assert snap["tp"]["started"] == 6 and [e["seq"] for e in snap["tp"]["last"]] == [4, 5, 6]
    assert snap["tp"]["last"][-1]["waiting"] and snap["tp"]["last"][-1]["ended_at"] is None
    assert snap["pp"]["started"] == 0 and snap["pp"]["p2p_started"] == 1
    assert snap["pp"]["last"][0]["peers"] == [2]


def _state(rank, groups, where=("  File x.py, line 1, in f\n",)):
    return {"rank": rank, "world_size": 4, "host": "h", "pid": rank, "time": 10.0,
            "request": {"kind": "failure", "rank": 0, "what": "x", "time": 9.0, "n": 1},
            "failure": True, "groups": groups, "where": list(where)}


def _g(name, ranks, started, waiting=(), p2p=0):
    return {"group": name, "ranks": ranks, "started": started, "p2p_started": p2p,
            "waiting": [{"seq": s, "op": "all_reduce", "started_at": 5.0, **extra}
                        for s, extra in waiting], "last": []}


def test_the_summary_follows_the_waits_to_the_rank_that_waits_for_nobody():
    """Rank 0 waits on dp for rank 2, which waits on tp for rank 3, which computes; rank 1
    wrote no dump and rank 0 waits for it on tp."""
    states = {0: _state(0, [_g("dp", [0, 2], 7, [(7, {})]), _g("tp", [0, 1], 3)]),
              2: _state(2, [_g("dp", [0, 2], 6), _g("tp", [2, 3], 9, [(9, {})])]),
              3: _state(3, [_g("tp", [2, 3], 8)])}
    text, s = summarize(states, 4)
    assert s["did_not_arrive"] == [3] and s["no_dump"] == [1] and not s["cycle"], s
    assert s["groups"] == [{"group": "tp", "ranks": [2, 3]}]
    states[0]["groups"][1]["waiting"] = [{"seq": 4, "op": "broadcast", "started_at": 5.0}]
    _, s = summarize(states, 4)
    assert s["did_not_arrive"] == [1, 3], s  # no dump: waited for, waits for nobody
    assert "no dump" in summarize(states, 4)[0]
    # two ranks in different collectives, each waiting for the other: both named, a cycle
    cycle = {0: _state(0, [_g("dp", [0, 1], 5, [(5, {})]), _g("tp", [0, 1], 2)]),
             1: _state(1, [_g("dp", [0, 1], 4), _g("tp", [0, 1], 3, [(3, {})])])}
    _, s = summarize(cycle, 2)
    assert s["did_not_arrive"] == [0, 1] and s["cycle"], s
    # pipeline transfers: a peer that transfers with the waiting rank does not block it
    p2p = {0: _state(0, [_g("pp", [0, 1], 0, [(4, {"peers": [1]})], p2p=4)]),
           1: _state(1, [_g("pp", [0, 1], 0, [(4, {"peers": [0]})], p2p=4)])}
    assert summarize(p2p, 2)[1]["did_not_arrive"] == []
    p2p[1]["groups"][0]["waiting"] = []
    assert summarize(p2p, 2)[1]["did_not_arrive"] == [1]


def test_a_signal_dumps_a_single_rank_while_it_runs(tmp_path):
    """World of one (no store): SIGUSR2 makes the watch thread write the dump and summary."""
    rec = FlightRecorder(rank=0, history=4)
    rec.done(rec.started("all_reduce", _group("dp", [0, 1], 0), 8))
    with HangWatch(rec, tmp_path, 0, 1, wait_s=1.0, signal_name="SIGUSR2"):
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for((tmp_path / "hang" / "live" / "summary.txt").exists, "no summary", 10)
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # restored
    states, world, req = load_dumps(tmp_path / "hang")
    assert world == 1 and req["kind"] == "signal" and list(states) == [0]
    assert states[0]["groups"][0]["started"] == 1


def test_the_watch_runs_when_its_descriptors_are_numbered_past_1024(tmp_path):
    """A process with many descriptors open (gloo sockets, token shards): the watch's wake-up
    socket gets a number >= 1024, past what select.select takes; the signal dump still comes."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the open-file limit ({soft}) is below the 1,100 descriptors needed")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        test_a_signal_dumps_a_single_rank_while_it_runs(tmp_path)
    finally:
        for fd in held:
            os.close(fd)


def test_outside_the_watch_a_failure_dumps_the_failing_rank_alone(tmp_path):
    """Set-up and resume run outside `fit`'s watch: no request, no summary, one dump."""
    rec = FlightRecorder(rank=3, history=4)
    HangWatch(rec, tmp_path, 3, 4, wait_s=1.0, signal_name=None, store=None)
    entry = rec.started("barrier", _group("checkpoint", [0, 1, 2, 3], 3), 0)
    rec.waiting(entry)
    rec.failed(entry, "barrier on the checkpoint group", RuntimeError("timed out"))
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["rank00003.json"]
    states, world, req = load_dumps(tmp_path / "hang")
    assert req["what"] == "barrier on the checkpoint group failed: timed out" and world == 4
    assert states[3]["groups"][0]["last"][0]["failed"]
    _, summary = summarize(states, world, req)
    assert summary["no_dump"] == [0, 1, 2] and summary["did_not_arrive"] == [0, 1, 2]


@pytest.mark.parametrize("overrides, key", [
    (["resilience.hang_history=0"], "resilience.hang_history"),
    (["resilience.hang_wait_s=0"], "resilience.hang_wait_s"),
    (["resilience.hang_signal=SIGTERM"], "resilience.hang_signal"),
    (["resilience.hang_signal=SIGUSR1", "train.exit_signal=SIGUSR1"],
     "resilience.hang_signal")])
def test_bad_hang_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(load_config(overrides))


class FakeWork:
    """A work handle whose completion the test decides, with NCCL's semantics: it may never
    complete, and `is_completed` is true for an errored or timed-out work too
    (`exception() || finishedGPUExecution`), whose `exception()` holds the error."""

    def __init__(self, completed: bool = False):
        self.completed = completed
        self.error = None
        self.asked = 0

    def is_completed(self) -> bool:
        self.asked += 1
        return self.completed or self.error is not None

    def exception(self):
        return self.error


class FakeEvent:
    """A CUDA event on a stream that has (or has not) reached it."""

    def __init__(self, reached: bool = False):
        self.reached = reached

    def query(self) -> bool:
        return self.reached


def _entries(rec, group):
    return {g["group"]: g for g in rec.snapshot()}[group]


def test_completion_is_judged_by_the_probe_not_by_a_return():
    """The recorder's state machine against a work handle that never completes: launched and
    returned is not done; past the group's threshold it is stuck, reported once; its probe
    firing later makes it done (and the probe is dropped); a blocking host call is done when
    it returns; a gloo point-to-point batch nobody waits for is not judged; an arrival event
    not reached yet keeps the device behind its launches."""
    rec = FlightRecorder(rank=0, history=8, hang_after_s=1.0, thresholds={"checkpoint": 5.0})
    dp, ckpt = _group("dp", [0, 1], 0), _group("checkpoint", [0, 1], 0)
    pp = _group("pp", [0, 1], 0)
    rec.done(rec.started("all_reduce", dp, 8))  # #1: a blocking host call (gloo) that returned
    work = FakeWork()
    entry = rec.started("all_reduce", dp, 8)  # #2: NCCL's async all-reduce, waited for:
    rec.complete_when(entry, work)            # wait() returned, the work has not completed
    t0 = entry[STARTED_AT]
    assert rec.poll(t0 + 0.5) == [] and work.asked == 1
    assert _entries(rec, "dp")["completed"] == 1 and _entries(rec, "dp")["started"] == 2
    (stuck,) = rec.poll(t0 + 1.5)  # past dp's threshold: stuck, once
    assert stuck[:3] == ("dp", [0, 1], 1.0) and stuck[3] is entry and entry[STUCK]
    assert rec.poll(t0 + 2.0) == []
    slow = rec.started("barrier", ckpt, 0)  # the checkpoint group's own threshold (5 s)
    rec.waiting(slow)
    assert rec.poll(slow[STARTED_AT] + 2.0) == []
    assert [s[0] for s in rec.poll(slow[STARTED_AT] + 6.0)] == ["checkpoint"]
    batch = rec.started("send/recv", pp, 32, peers=[1])  # gloo: no probe, nobody waits yet
    assert rec.poll(batch[STARTED_AT] + 10) == [] and batch[ENDED_AT] is None
    rec.waiting(batch)  # a thread blocks in its wait: judged from its launch
    assert [s[3] for s in rec.poll(batch[STARTED_AT] + 10)] == [batch]
    rec.done(batch)
    assert _entries(rec, "pp")["p2p_with"] == {"1": 1}
    work.completed = True  # it completes after all
    assert rec.poll(t0 + 3.0) == [] and entry[ENDED_AT] == t0 + 3.0 and entry[PROBE] is None
    assert _entries(rec, "dp")["completed"] == 2
    event = FakeEvent()  # CUDA: launched, the stream not at it yet (a kernel before it runs)
    late = rec.started("all_reduce", dp, 8)
    rec.arrives_when(late, event)
    rec.complete_when(late, FakeWork())
    dp_now = _entries(rec, "dp")
    assert (dp_now["started"], dp_now["arrived"], dp_now["completed"]) == (3, 2, 2)
    event.reached = True
    assert _entries(rec, "dp")["arrived"] == 3
    rec.poll(time.time())
    assert late[ARRIVAL] is None  # dropped once reached


def test_an_incomplete_collective_is_not_evicted_by_later_ones():
    """History 4: an all-reduce that does not complete, then 10 completed ones on its group:
    it stays in the snapshot (the group's completed counter stops before it) and is judged
    stuck past the threshold; once it completes it is let go."""
    rec = FlightRecorder(rank=0, history=4, hang_after_s=1.0)
    dp = _group("dp", [0, 1], 0)
    work = FakeWork()
    slow = rec.started("reduce_scatter", dp, 8)
    rec.complete_when(slow, work)
    for _ in range(10):
        rec.done(rec.started("all_reduce", dp, 8))
    dp_now = _entries(rec, "dp")
    assert dp_now["started"] == 11 and dp_now["completed"] == 0
    assert [e["seq"] for e in dp_now["last"]] == [1, 8, 9, 10, 11]
    assert [s[3] for s in rec.poll(slow[STARTED_AT] + 2.0)] == [slow]
    work.completed = True
    rec.poll(time.time())
    dp_now = _entries(rec, "dp")
    assert dp_now["completed"] == 11 and [e["seq"] for e in dp_now["last"]] == [8, 9, 10, 11]


def test_a_stuck_collective_outlives_many_completed_async_ones_between_polls():
    """History 4, no poll: a stuck reduce-scatter, then 20 asynchronous all-reduces whose Works
    have completed (NCCL: marked only at a poll). Those leave the ring as complete, not pinned,
    so the stuck one is still there, and the completed counter counts them."""
    rec = FlightRecorder(rank=0, history=4, hang_after_s=1.0)
    dp = _group("dp", [0, 1], 0)
    slow = rec.started("reduce_scatter", dp, 8)
    rec.complete_when(slow, FakeWork())
    for _ in range(20):
        done = FakeWork()
        done.completed = True
        rec.complete_when(rec.started("all_reduce", dp, 8), done)
    dp_now = _entries(rec, "dp")
    assert dp_now["last"][0]["seq"] == 1 and len(dp_now["last"]) == 5
    assert [s[3] for s in rec.poll(slow[STARTED_AT] + 2.0)] == [slow]


class RaisingProbe:
    """A probe whose query raises (a sticky CUDA error), or a Work whose `exception()`
    raises."""

    def __init__(self, where: str):
        self.where = where

    def is_completed(self) -> bool:
        if self.where == "query":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return True

    def exception(self):
        raise RuntimeError("no exception to read")


def test_a_work_that_ended_with_an_error_is_failed_not_completed():
    """NCCL's `is_completed` is true for an errored work: the recorder reads `exception()`:
    set (or raising), the operation is failed, reported by `poll` once, never completed
    (the group's completed counter stays below it, its entry names the error); a probe
    whose query raises fails its operation and does not stop the look at the others."""
    rec = FlightRecorder(rank=0, history=8, hang_after_s=100.0)
    dp = _group("dp", [0, 1], 0)
    work, ok = FakeWork(), FakeWork(completed=True)
    errored = rec.started("all_reduce", dp, 8)
    rec.complete_when(errored, work)
    rec.complete_when(rec.started("all_reduce", dp, 8), ok)
    work.error = RuntimeError("NCCL error: remote process exited")
    (failed,) = rec.poll(time.time())
    assert failed[0] == "dp" and failed[3] is errored and errored[FAILED]
    assert errored[ENDED_AT] is None and "remote process exited" in errored[ERROR]
    assert rec.poll(time.time()) == []  # once
    dp_now = _entries(rec, "dp")
    assert dp_now["completed"] == 0 and dp_now["started"] == 2  # #1 never completed
    assert dp_now["last"][0]["failed"] and "remote" in dp_now["last"][0]["error"]
    raising = [rec.started("all_reduce", dp, 8) for _ in range(2)]
    rec.complete_when(raising[0], RaisingProbe("query"))
    rec.complete_when(raising[1], RaisingProbe("exception"))
    assert [s[3] for s in rec.poll(time.time())] == raising
    assert all(e[FAILED] and e[ENDED_AT] is None for e in raising)
    assert "illegal memory access" in raising[0][ERROR] and "raised" in raising[1][ERROR]


def test_a_stuck_operation_is_dumped_and_becomes_a_live_dump_when_it_completes(tmp_path):
    """In one process over an in-memory store: rank 0's all-reduce never completes (rank 1
    launched fewer there); rank 0's watch dumps, rank 1's answers, the summary in hang/
    names rank 1. The all-reduce completing after all moves both dumps and the summary to
    hang/live/ (a `resolved` request): nothing is left as a failure's evidence."""
    store = dist.HashStore()
    recs = [FlightRecorder(rank=r, history=8, hang_after_s=0.2) for r in (0, 1)]
    groups = [_group("dp", [0, 1], r) for r in (0, 1)]
    for rec, group in zip(recs, groups):
        rec.done(rec.started("all_reduce", group, 8))
    work = FakeWork()
    rec0_entry = recs[0].started("all_reduce", groups[0], 8)
    recs[0].complete_when(rec0_entry, work)
    watches = [HangWatch(rec, tmp_path / "run", r, 2, wait_s=2.0, signal_name=None,
                         store=store) for r, rec in enumerate(recs)]
    hang = tmp_path / "run" / "hang"
    with watches[0], watches[1]:
        wait_for((hang / "summary.json").exists, "no summary of the stuck all-reduce")
        summary = json.loads((hang / "summary.json").read_text())
        dumps = sorted(p.name for p in hang.glob("rank*.json"))
        work.completed = True
        wait_for((hang / "live" / "summary.json").exists, "the dump did not become live")
        wait_for(lambda: not (hang / "rank00001.json").exists(), "rank 1 kept its dump")
    assert summary["request"]["kind"] == "stuck" and summary["did_not_arrive"] == [1], summary
    assert "not complete" in summary["request"]["what"] and "#2" in summary["request"]["what"]
    (wait,) = summary["waits"]
    assert wait["rank"] == 0 and wait["stuck"] and wait["behind"] == {"1": 1}, wait
    assert dumps == ["rank00000.json", "rank00001.json"]
    assert not any(hang.glob("rank*.json")) and not (hang / "summary.txt").exists()
    assert sorted(p.name for p in (hang / "live").iterdir()) == [
        "rank00000.json", "rank00001.json", "summary.json", "summary.txt"]
    assert not watches[0].failure_dumped and not watches[1].failure_dumped


def _two_watches(tmp_path, hang_after_s):
    """Ranks 0 and 1 over an in-memory store, each with one completed all-reduce on dp; rank
    0 with a second one whose work the test decides. Returns (recorders, watches, work)."""
    store = dist.HashStore()
    recs = [FlightRecorder(rank=r, history=8, hang_after_s=hang_after_s) for r in (0, 1)]
    groups = [_group("dp", [0, 1], r) for r in (0, 1)]
    for rec, group in zip(recs, groups):
        rec.done(rec.started("all_reduce", group, 8))
    work = FakeWork()
    recs[0].complete_when(recs[0].started("all_reduce", groups[0], 8), work)
    watches = [HangWatch(rec, tmp_path / "run", r, 2, wait_s=2.0, signal_name=None,
                         store=store) for r, rec in enumerate(recs)]
    return recs, watches, work


@pytest.mark.parametrize("when", ["after its stuck dump", "before the threshold"])
def test_a_work_that_ended_with_an_error_is_a_failure_not_a_completion(tmp_path, when):
    """NCCL's `is_completed` is true for an errored work (a watchdog timeout after the stuck
    dump; a remote error before the threshold): the summary in hang/ names the operation
    failed, both ranks' dumps stay in hang/ as the evidence, nothing moves to hang/live/."""
    _, watches, work = _two_watches(tmp_path, 0.2 if when.startswith("after") else 100.0)
    hang = tmp_path / "run" / "hang"
    with watches[0], watches[1]:
        if when.startswith("after"):
            wait_for((hang / "summary.json").exists, "no summary of the stuck all-reduce")
        work.error = RuntimeError("Watchdog caught collective operation timeout")
        wait_for(lambda: (hang / "summary.json").exists() and "failed" in json.loads(
            (hang / "summary.json").read_text())["request"].get(
                "failed" if when.startswith("after") else "what", ""),
            "the summary does not name the all-reduce failed")
        time.sleep(0.5)  # a few more looks: nothing may move to hang/live/
    text = (hang / "summary.txt").read_text()
    assert "all_reduce #2 on the dp group" in text and "failed" in text
    assert "Watchdog caught collective operation timeout" in text, text
    assert sorted(p.name for p in hang.glob("rank*.json")) == ["rank00000.json",
                                                               "rank00001.json"]
    assert not (hang / "live").exists() or not any((hang / "live").iterdir())
    assert watches[0].failure_dumped


def test_a_look_that_raises_does_not_stop_the_rank_answering(tmp_path):
    """Rank 1's look at its own operations raises at every poll (a sticky CUDA error in a
    probe's query): its watch still answers rank 0's request, so the summary has both
    ranks' dumps."""
    recs, watches, _ = _two_watches(tmp_path, 100.0)

    def broken(now):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    recs[1].poll = broken
    with watches[0], watches[1]:
        path = watches[0].request("signal", "a live dump asked by rank 0")
    summary = json.loads(path.with_suffix(".json").read_text())
    assert summary["dumps"] == [0, 1] and summary["no_dump"] == [], summary


@pytest.mark.parametrize("overrides, key", [
    (["resilience.hang_after_s=600"], "resilience.hang_after_s"),  # = parallel.timeout_s
    (["resilience.hang_after_s=20", "parallel.timeout_s=10"], "resilience.hang_after_s"),
    (["resilience.hang_after_s=0"], "resilience.hang_after_s")])
def test_a_hang_threshold_not_below_the_timeout_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(load_config(overrides))


def test_each_group_gets_the_same_fraction_of_its_own_timeout():
    res = load_config(["resilience.hang_after_s=300"]).resilience
    assert res.hang_thresholds(600.0, 3600.0) == (300.0, 1800.0)
    res = load_config([]).resilience  # null: 0.8 of each
    assert res.hang_thresholds(600.0, 3600.0) == pytest.approx((480.0, 2880.0))


def test_the_watching_features_own_work_is_measured_per_operation():
    """`megalite-bench pipeline-launch --costs`' in-process part (docs/hangs.md, what watching
    costs): the recorder's calls for a collective and a pipeline batch, the wait timing and a
    look of the watch, at a few calls each."""
    import math

    from megalite_bench.launch_pipeline import instrument_costs

    costs = instrument_costs(calls=200)
    assert set(costs) == {"flight_collective", "flight_batch", "wait_timing", "look"}
    assert all(math.isfinite(v) and v < 1e-2 for v in costs.values()), costs
    assert costs["flight_collective"] > 0 and costs["flight_batch"] > 0 and costs["look"] > 0
