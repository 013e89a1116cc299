"""Hang dumps (megalite.resilience.flight / hang / hang_report): a rank that stops
participating makes its peer's collective time out; every rank writes its stacks and last
collectives, and the summary names the missing rank and the group. A signal dumps a live run."""
from __future__ import annotations

import os
import signal
import time

import pytest

from megalite.config.errors import ConfigError
from megalite.config.schema import check_sections, load_config
from megalite.parallel.group import Group, single_rank_group
from megalite.resilience.flight import FlightRecorder
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
