"""Hang dumps (megalite.resilience.flight / hang / hang_report): a rank that stops
participating makes its peer's collective time out; every rank writes its stacks and last
collectives, and the summary names the missing rank and the group. A signal dumps a live run."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from megalite.cli.hang_report import main
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.parallel.calls import CommError
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT
from tests.unit.resilience.test_hang import wait_for

TIMEOUT_S = 3  # parallel.timeout_s: rank 0's cp collective raises after this long
HANG_AFTER = 1.5  # resilience.hang_after_s: it is dumped as stuck after this long
STALL_AT = 3  # rank 1 stops participating before this step
SIGNAL_AFTER = 1  # rank 0 signals itself after this step (a live dump)


class Stopped(Exception):
    """Rank 1 leaves the run (after it has been dumped)."""


def _failure_dumped(path: Path) -> bool:
    return path.exists() and json.loads(path.read_text())["failure"]


def _stall_until_dumped(hang_dir: Path, rank: int) -> None:
    """This rank stops participating: it waits, outside any collective, until the watch
    thread has written its dump for the failure its peer ran into, then leaves."""
    wait_for(lambda: _failure_dumped(hang_dir / f"rank{rank:05d}.json"), "no failure dump")
    raise Stopped()


def _hung_run(rank, world, tiny_data, run_dir):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "cp=2", "zero=1", "train.max_steps=6", f"parallel.timeout_s={TIMEOUT_S}",
        f"resilience.hang_after_s={HANG_AFTER}", "resilience.hang_wait_s=2",
        "resilience.check_every=0",
        "resilience.straggler_report_every=0", "log.peak_tflops=1"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), Path(run_dir))
    hang_dir = Path(run_dir) / "hang"
    step = trainer.train_step

    def train_step():
        if rank == 1 and trainer.step + 1 == STALL_AT:
            _stall_until_dumped(hang_dir, rank)
        result = step()
        if rank == 0 and trainer.step == SIGNAL_AFTER:
            os.kill(os.getpid(), signal.SIGUSR2)
        if trainer.step == SIGNAL_AFTER + 1:  # both, outside collectives: no rank times out
            wait_for((hang_dir / "live" / "summary.json").exists, "no summary of the live dump")
        return result

    trainer.train_step = train_step
    error = None
    try:
        trainer.fit()
    except (CommError, Stopped) as e:
        error = type(e).__name__ + ": " + str(e)
    return {"error": error, "step": trainer.step}


@pytest.mark.distributed
def test_a_rank_that_stops_participating_is_named_with_its_group(tmp_path, tiny_data, capsys):
    """Rank 1 stalls before step 3 outside any collective. Rank 0's next collective (cp 2:
    the first block's all-gather of keys and values over the cp group) is not complete after
    resilience.hang_after_s: its watch dumps, asks rank 1 through the store,
    whose watch thread dumps while its main thread stalls; the summary (written by rank 0,
    and by megalite-hang-report afterwards) names rank 1 and the group rank 0 waited in. Then
    the collective times out (gloo raises at parallel.timeout_s): CommError, after the dumps,
    which stay the evidence. Before that, SIGUSR2 to rank 0 dumped every rank of the live
    run, which went on training."""
    run_dir = tmp_path / "run"
    res = run_ranks(_hung_run, 2, args=(str(tiny_data), str(run_dir)), timeout_s=120)
    assert res[0]["error"].startswith("CommError") and res[0]["step"] == STALL_AT - 1, res
    assert res[1]["error"].startswith("Stopped"), res
    # the live dumps (hang/live/) are still there: the failure's dumps went to hang/
    live = {r: json.loads((run_dir / "hang" / "live" / f"rank{r:05d}.json").read_text())
            for r in (0, 1)}
    for dump in live.values():
        assert dump["request"]["kind"] == "signal" and not dump["failure"], dump["request"]
        assert dump["request"]["what"] == "SIGUSR2 received by rank 0"
        assert dump["request"]["n"] == 1  # one signal, one request

    hang = run_dir / "hang"
    dumps = {r: json.loads((hang / f"rank{r:05d}.json").read_text()) for r in (0, 1)}
    assert all(d["failure"] and d["request"]["kind"] == "stuck" for d in dumps.values())
    assert dumps[1]["request"]["n"] == 2  # rank 0's, numbered after its own dump
    assert "all_gather #" in dumps[0]["request"]["what"]
    assert "on the cp group (global ranks [0, 1])" in dumps[0]["request"]["what"]
    assert "not complete" in dumps[0]["request"]["what"]
    assert f"threshold: {HANG_AFTER:g} s" in dumps[0]["request"]["what"]
    assert "timed out" in res[0]["error"].lower() or "failed" in res[0]["error"]
    main_stack = {r: next(v for k, v in d["stacks"].items() if k.startswith("MainThread"))
                  for r, d in dumps.items()}
    assert "in run_guarded" in "".join(main_stack[0]), main_stack[0][-3:]  # in comm
    assert "in _stall_until_dumped" in "".join(main_stack[1][-3:]), main_stack[1][-3:]
    assert any(k.startswith("megalite-hang-watch") for k in dumps[1]["stacks"])

    summary = json.loads((hang / "summary.json").read_text())
    assert summary["did_not_arrive"] == [1] and summary["no_dump"] == [], summary
    (wait,) = [w for w in summary["waits"] if w["behind"]]
    group = next(g for g in dumps[0]["groups"]
                 if g["group"] == wait["group"] and g["ranks"] == wait["ranks"])
    theirs = next(g for g in dumps[1]["groups"]
                  if g["group"] == wait["group"] and g["ranks"] == wait["ranks"])
    waited = [e for e in group["last"] if e["waiting"]]
    assert wait["rank"] == 0 and wait["ranks"] == [0, 1] and waited[-1]["stuck"], wait
    assert waited[-1]["seq"] == wait["seq"] == group["started"] > theirs["started"]
    assert wait["behind"] == {"1": theirs["started"]}, wait
    assert all(e["ended_at"] for e in theirs["last"]), theirs  # rank 1 waits in none
    assert summary["groups"] == [{"group": wait["group"], "ranks": [0, 1]}]
    text = (hang / "summary.txt").read_text()
    assert f"did not arrive: rank 1 in the {wait['group']} group (global ranks [0, 1])" in text
    assert "_stall_until_dumped" in text, text  # where rank 1's main thread is

    main([str(run_dir)])  # megalite-hang-report reads the files afterwards: the same verdict
    printed = capsys.readouterr().out
    assert f"did not arrive: rank 1 in the {wait['group']} group" in printed, printed


HANG_AFTER_S = 1.0  # the stuck scenarios' threshold (their world has no trainer)
STUCK_RANK = 2  # stage 0 of the second pipeline: its dp peer (rank 0) all-reduces with it,
#                 its pp peer (rank 3) receives from it


def _outside_any_wait(until, limit_s: float = 60.0) -> None:
    """Blocked elsewhere, as a CUDA synchronisation (`.item()`) blocks a host: no flight-
    recorder wait is open."""
    wait_for(until, "the scenario did not come about", limit_s)


def _stuck_scenarios(rank, world, run_dir):
    """Two scenarios in one world of 4 (pp 2 x dp 2, gloo), each over a fresh store prefix:
    every rank launches an asynchronous all-reduce (dp) and a pipeline transfer (stage 0
    sends, stage 1 receives) and then blocks outside any wait; in `stuck` rank 2 is stuck in
    compute before it launches anything (until the summary is written), in `healthy`
    nobody is. Counts the hang watch's looks and store operations."""
    import torch
    import torch.distributed as dist

    from megalite.parallel import comm
    from megalite.parallel.topology import build_topology
    from megalite.resilience.flight import FlightRecorder
    from megalite.resilience.hang import HangWatch
    from megalite.resilience.hang_store import default_store
    from tests.unit.resilience.test_hang_store import CountingStore

    topo = build_topology(1, 2, 2)
    out = {}
    for scenario in ("stuck", "healthy"):
        hang = Path(run_dir) / scenario / "hang"
        recorder = FlightRecorder(rank, 32, hang_after_s=HANG_AFTER_S)
        topo.counter.flight = recorder
        store = CountingStore(dist.PrefixStore(f"{scenario}/", default_store()))
        watch = HangWatch(recorder, Path(run_dir) / scenario, rank, world, wait_s=2.0,
                          signal_name=None, store=store)
        looks = []
        look = watch._look_at_recorder
        watch._look_at_recorder = lambda: (looks.append(store.ops), look())[1]
        seen = None
        with watch:
            if scenario == "stuck" and rank == STUCK_RANK:  # the fault, in this rank only
                _outside_any_wait((hang / "summary.json").exists)
                seen = json.loads((hang / "summary.json").read_text())
            t = torch.ones(4)
            work = comm.all_reduce(t, topo.dp_group, async_op=True)
            buf = torch.ones(8)
            stage = topo.coords.pp_rank
            batch = comm.send_recv([(buf, 1)] if stage == 0 else [],
                                   [] if stage == 0 else [(buf, 0)], topo.pp_group,
                                   async_op=True)
            if scenario == "stuck":  # until every rank's dump has become a live one
                _outside_any_wait(lambda: (hang / "live" / f"rank{rank:05d}.json").exists()
                                  and not (hang / f"rank{rank:05d}.json").exists())
            else:
                ops_before, looks_before = store.ops, len(looks)
                time.sleep(HANG_AFTER_S * 2.5)
                busy, window = store.ops - ops_before, len(looks) - looks_before
            work.wait()
            batch.wait()
        out[scenario] = {"seen": seen, "sum": t.tolist(), "received": buf.tolist()}
        if scenario == "healthy":
            out[scenario].update(store_ops=busy, looks=window)
    return out


@pytest.mark.distributed
def test_a_rank_stuck_outside_any_wait_is_named_by_completion_not_by_an_error(tmp_path):
    """NCCL's semantics on gloo: the peers launch an asynchronous all-reduce and a pipeline
    receive and block elsewhere (no wait open, no error to raise); rank 2 is stuck in compute.
    Rank 0's all-reduce is not complete after resilience.hang_after_s: every rank dumps, the
    summary names rank 2 (in the dp group, and as the sender rank 3 waits for); rank 2 then
    goes on, the operations complete, the dumps become live ones and training goes on. With
    nobody stuck nothing is written, and the watch's store traffic is its one read a look."""
    res = run_ranks(_stuck_scenarios, 4, args=(str(tmp_path),), timeout_s=120)
    seen = res[STUCK_RANK]["stuck"]["seen"]
    assert seen["request"]["kind"] == "stuck" and seen["request"]["rank"] == 0, seen["request"]
    assert seen["did_not_arrive"] == [STUCK_RANK] and seen["no_dump"] == [], seen
    behind = {(w["rank"], w["group"], w["p2p"]): w["behind"] for w in seen["waits"]
              if w["behind"]}
    assert behind == {(0, "dp", False): {"2": 0}, (3, "pp", True): {"2": 0}}, behind
    assert seen["groups"] == [{"group": "dp", "ranks": [0, 2]},
                              {"group": "pp", "ranks": [2, 3]}], seen["groups"]
    hang = tmp_path / "stuck" / "hang"
    text = (hang / "live" / "summary.txt").read_text()
    assert "did not arrive: rank 2 in the dp group (global ranks [0, 2])" in text, text
    assert "_outside_any_wait" in text  # where rank 2's main thread was
    assert not list(hang.glob("rank*.json")) and not (hang / "summary.txt").exists()
    assert len(list((hang / "live").glob("rank*.json"))) == 4
    for r in range(4):  # it went on: every operation completed with its peers'
        assert res[r]["stuck"]["sum"] == [2.0] * 4 and res[r]["healthy"]["sum"] == [2.0] * 4
    assert not (tmp_path / "healthy" / "hang").exists()
    for r in range(4):
        healthy = res[r]["healthy"]
        assert healthy["looks"] >= 3, healthy  # it looked while every rank was blocked
        assert healthy["store_ops"] <= healthy["looks"] + 1, healthy  # one read a look
