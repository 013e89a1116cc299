"""The hang dumps' exchange through the c10d store (megalite.resilience.hang_store), on an
in-memory store (no ranks): answers scoped by request, the requesting rank's own request
answered once, store operations that do not grow with the world size; a live dump beside a
failure's; PyTorch's NCCL flight-recorder variables (megalite.resilience.nccl_flight)."""
from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from megalite.parallel.group import Group, single_rank_group
from megalite.resilience.flight import FlightRecorder
from megalite.resilience.hang import HangWatch
from megalite.resilience.hang_files import write_summary
from megalite.resilience.hang_store import HangExchange
from megalite.resilience.nccl_flight import nccl_flight_env, set_nccl_flight_env


class CountingStore:
    """A store that counts the operations made on it (each a round trip on a TCPStore)."""

    def __init__(self, store, on_add=None):
        self.store, self.ops, self.on_add = store, 0, on_add

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.ops += 1
            result = method(*args)
            if name == "add" and self.on_add is not None:
                self.on_add(*args)
            return result
        return counted


def _watch(tmp_path, rank, world, store, wait_s=0.3):
    rec = FlightRecorder(rank=rank, history=4, hang_after_s=600.0)
    group = Group(name="dp", ranks=list(range(min(world, 8))), rank=rank, pg=None,
                  counter=single_rank_group("dp").counter)
    rec.done(rec.started("all_reduce", group, 8))
    watch = HangWatch(rec, tmp_path, rank, world, wait_s=wait_s, signal_name=None, store=store)
    watch.recorder_group = group
    return watch


def _ops(store, fn) -> int:
    before = store.ops
    fn()
    return store.ops - before


def test_store_operations_per_look_answer_and_collect_do_not_grow_with_the_world(tmp_path):
    """As the docstring of hang_store says: a look 1, answering one request 3 (+ the look),
    collecting all answers 2 — on 2 ranks as on 4,096. The watch's look at its own recorder
    (what completed, what is stuck) makes none."""
    counts = {}
    for world in (2, 4096):
        store = CountingStore(dist.HashStore())
        watch = _watch(tmp_path / str(world), 1, world, store)
        pending = watch.recorder.started("all_reduce", watch.recorder_group, 8)
        watch.recorder.waiting(pending)  # in flight, not stuck: the watch's own look at the
        assert _ops(store, watch._look_at_recorder) == 0  # recorder needs no store
        look = _ops(store, watch._answer)  # no request yet
        req = {"kind": "signal", "rank": 0, "what": "x", "time": 0.0, "n": None}
        n = HangExchange(store.store).post(req)  # posted by rank 0, not counted here
        answer = _ops(store, watch._answer)
        store.store.add(f"acks/{n}", world - 1)  # every other rank has answered too
        states = {}
        collect = _ops(store, lambda: states.update(
            HangExchange(store).collect(n, world, wait_s=30)))
        assert list(states) == [1] and states[1]["request"]["n"] == n
        counts[world] = (look, answer, collect)
    assert counts[2] == counts[4096] == (1, 4, 2), counts


def test_each_request_reads_only_the_answers_to_it(tmp_path):
    """Rank 1 answers request 1, then stops answering: request 2's summary finds no dump of
    rank 1 (its answer to request 1 is not taken for one to request 2)."""
    store = dist.HashStore()
    w0, w1 = _watch(tmp_path, 0, 2, store), _watch(tmp_path, 1, 2, store)
    stop = threading.Event()

    def answering():
        while not stop.is_set():
            w1._answer()
            time.sleep(0.01)
    helper = threading.Thread(target=answering)
    helper.start()
    try:
        first = json.loads(w0.request("signal", "first").with_name("summary.json").read_text())
    finally:
        stop.set()
        helper.join()
    assert first["dumps"] == [0, 1] and first["no_dump"] == [], first
    second = json.loads(w0.request("signal", "second").with_name("summary.json").read_text())
    assert second["request"]["n"] == 2 and second["dumps"] == [0], second
    assert second["no_dump"] == [1], second


def test_the_requesting_rank_answers_its_own_request_once(tmp_path):
    """The requesting rank's watch looks while the request is being numbered (the store
    answers the numbering slowly): it waits and skips its own request, no second dump."""
    looks = []

    def look_meanwhile(key, amount):
        if key == "requests" and amount == 1:
            looks.append(threading.Thread(target=watch._answer))
            looks[-1].start()
            time.sleep(0.2)
    store = CountingStore(dist.HashStore(), on_add=look_meanwhile)
    watch = _watch(tmp_path, 0, 1, store)
    watch.request("signal", "x")
    looks[0].join()
    assert store.store.get("states/1").decode().count("\n") == 1  # one answer: its own
    assert watch.seen == 1 and watch.own == {1}


def test_a_live_dump_keeps_the_failure_dump_and_the_first_summary(tmp_path):
    """A failure dumps to hang/, a later signal to hang/live/; of two failure summaries the
    first is kept."""
    store = dist.HashStore()
    watch = _watch(tmp_path, 0, 1, store, wait_s=1.0)
    group = Group(name="tp", ranks=[0, 1], rank=0, pg=None, counter=single_rank_group("tp").counter)
    with watch:
        entry = watch.recorder.started("all_reduce", group, 4)
        watch.recorder.waiting(entry)
        watch.recorder.failed(entry, "all_reduce on the tp group", RuntimeError("timed out"))
        watch.request("signal", "SIGUSR2 received by rank 0")
    hang = tmp_path / "hang"
    failure = json.loads((hang / "rank00000.json").read_text())
    live = json.loads((hang / "live" / "rank00000.json").read_text())
    assert failure["failure"] and failure["request"]["kind"] == "failure"
    assert not live["failure"] and live["request"]["n"] == 2
    first = (hang / "summary.txt").read_text()
    assert first.startswith("hang summary (failure on rank 0")
    write_summary(hang, "a second rank's summary", {}, keep_first=True)
    assert (hang / "summary.txt").read_text() == first
    assert sorted(p.name for p in hang.iterdir()) == ["live", "rank00000.json", "summary.json",
                                                      "summary.txt"]  # no temporary left


def test_nccl_flight_recorder_variables_leave_the_users_alone(tmp_path):
    assert nccl_flight_env({}) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                                   "TORCH_FR_BUFFER_SIZE": "2000",
                                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_flight_env({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) == {}
    env = {}
    assert set_nccl_flight_env(tmp_path, env) == env
    prefix = str(tmp_path / "hang" / "nccl" / "nccl_trace_rank_")
    assert env == {"TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    assert (tmp_path / "hang" / "nccl").is_dir()
    assert nccl_flight_env({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"}, tmp_path) == {}


def test_a_stuck_request_resolved_before_a_rank_looked_is_not_answered(tmp_path):
    """Rank 0's stuck operation completed after all before rank 1's watch looked: rank 1
    sees the stuck request and its `resolved` in one look and writes no dump (a failure's
    would stay in hang/ as the evidence of a hang that resolved); a later request is
    answered as before."""
    store = dist.HashStore()
    watch = _watch(tmp_path, 1, 2, store)
    exchange = HangExchange(store)
    stuck = exchange.post({"kind": "stuck", "rank": 0, "what": "x", "time": 0.0, "n": None})
    exchange.post({"kind": "resolved", "rank": 0, "what": "y", "time": 0.0, "n": None,
                   "of": stuck})
    watch._answer()
    assert not (tmp_path / "hang").exists() and not watch.failure_dumped
    assert store.add(f"acks/{stuck}", 0) == 0
    later = exchange.post({"kind": "signal", "rank": 0, "what": "z", "time": 0.0, "n": None})
    watch._answer()
    assert store.add(f"acks/{later}", 0) == 1
    assert (tmp_path / "hang" / "live" / "rank00001.json").exists()
