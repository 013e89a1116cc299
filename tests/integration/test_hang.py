"""Hang dumps (megalite.resilience.flight / hang / hang_report): a rank that stops
participating makes its peer's collective time out; every rank writes its stacks and last
collectives, and the summary names the missing rank and the group. A signal dumps a live run."""
from __future__ import annotations

import json
import os
import signal
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
from tests.unit.test_hang import wait_for

TIMEOUT_S = 3  # parallel.timeout_s: rank 0 waits this long in its dp collective
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
        "zero=1", "train.max_steps=6", f"parallel.timeout_s={TIMEOUT_S}",
        "resilience.hang_wait_s=2", "resilience.check_every=0",
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
    """Rank 1 stalls before step 3 outside any collective. Rank 0's next collective times out:
    it dumps, asks rank 1 through the store, whose watch thread dumps while its main thread
    stalls; the summary (written by rank 0, and by megalite-hang-report afterwards) names
    rank 1 and the group rank 0 waited in. Before that, SIGUSR2 to rank 0 dumped every rank
    of the live run, which went on training."""
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
    assert all(d["failure"] and d["request"]["kind"] == "failure" for d in dumps.values())
    assert dumps[1]["request"]["n"] == 2  # rank 0's, numbered after its own dump
    assert "timed out" in dumps[0]["request"]["what"] or "failed" in dumps[0]["request"]["what"]
    main_stack = {r: next(v for k, v in d["stacks"].items() if k.startswith("MainThread"))
                  for r, d in dumps.items()}
    assert "in call" in "".join(main_stack[0]), main_stack[0][-3:]  # waiting in comm
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
    assert wait["rank"] == 0 and wait["ranks"] == [0, 1] and waited[-1]["failed"], wait
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
