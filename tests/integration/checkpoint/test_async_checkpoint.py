"""Background checkpoint saves (checkpoint.async_save): the same checkpoints as saves in the
training thread, written while training goes on, and a failed background save publishes
nothing and is raised in the training loop on every rank."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from megalite.checkpoint import save as ckpt_save
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import read_meta
from megalite.checkpoint.resolve import complete_checkpoints
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

SLOW_S = 0.6  # every rank's file writing is held up this long, so training overtakes it
EVERY, STEPS = 2, 6


def _run(rank, world, tiny_data, run_dir, async_save, fail_at=None, resume=False):
    """Train STEPS steps on dp2 zero1, saving every EVERY steps with slowed-down writes; rank 1's
    write of step `fail_at` raises. Returns the records, (snapshot step, training step when
    its files were written) per save, and the error raised by fit, if any."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "zero=1", f"train.max_steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=5",
        f"checkpoint.dir={run_dir}/ckpt", f"checkpoint.async_save={async_save}",
        f"checkpoint.resume={'auto' if resume else 'none'}"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), Path(run_dir))
    start = trainer.step
    write, written = ckpt_save._write_rank_files, []

    def slow_write(tmp, snap, r):
        time.sleep(SLOW_S)
        if snap.step == fail_at and r == 1:
            raise OSError(28, "No space left on device")
        out = write(tmp, snap, r)
        written.append((snap.step, trainer.step))
        return out

    ckpt_save._write_rank_files = slow_write
    error = None
    try:
        records = trainer.fit()
    except CheckpointError as e:
        records, error = [], str(e)
    finally:
        ckpt_save._write_rank_files = write
    return {"records": records, "written": written, "error": error, "start": start}


@pytest.mark.distributed
def test_async_saves_equal_sync_saves_and_overlap_training(tiny_data, tmp_path):
    """Same losses, and byte-identical checkpoints at steps 2, 4, 6 (so the background save
    wrote the state of its step although training had moved on: the writes of steps 2 and 4
    ended after later steps had run). The loop waited for every save at least SLOW_S in the
    training thread; in the background only for the snapshot where no earlier save was still
    being written (step 2), and for the rest of the previous save's writing elsewhere."""
    sync = run_ranks(_run, 2, args=(tiny_data, str(tmp_path / "sync"), False), timeout_s=600)
    bg = run_ranks(_run, 2, args=(tiny_data, str(tmp_path / "async"), True), timeout_s=600)
    for s, a in zip(sync, bg):
        assert [r["loss"] for r in s["records"]] == [r["loss"] for r in a["records"]]
        assert all(step == now for step, now in s["written"])
        assert [step for step, _ in a["written"]] == [2, 4, 6]
        assert all(now > step for step, now in a["written"][:2]), a["written"]
        blocked_sync = {r["step"]: r["checkpoint_blocked_s"] for r in s["records"]}
        blocked_async = {r["step"]: r["checkpoint_blocked_s"] for r in a["records"]}
        assert all(blocked_sync[step] >= SLOW_S for step in (2, 4, 6)), blocked_sync
        assert blocked_async[2] < SLOW_S / 3, blocked_async
        assert sum(blocked_async.values()) < sum(blocked_sync.values())
        assert blocked_async[1] == blocked_sync[1] == 0.0
    for step in (2, 4, 6):
        d_sync = tmp_path / "sync" / "ckpt" / f"step_{step:08d}"
        d_async = tmp_path / "async" / "ckpt" / f"step_{step:08d}"
        m_sync, m_async = read_meta(d_sync), read_meta(d_async)
        for key in ("step", "consumed_samples", "sampler", "adam_step", "tensors", "layout"):
            assert m_sync[key] == m_async[key], (step, key)
        assert {k: v["crc32"] for k, v in m_sync["files"].items() if k.endswith(".bin")} \
            == {k: v["crc32"] for k, v in m_async["files"].items() if k.endswith(".bin")}
        for name in ("rank00000.bin", "rank00001.bin"):
            assert (d_sync / name).read_bytes() == (d_async / name).read_bytes(), (step, name)


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_publishes_nothing_and_stops_every_rank(tiny_data, tmp_path, async_save):
    """Rank 1 cannot write step 4: no rank publishes it, every rank's fit raises an error naming
    rank 1 and the checkpoint (in the background: at the next save), no later save is
    started, and resume=auto continues from step 2 (the unfinished step_4.tmp deleted)."""
    run_dir = str(tmp_path / "run")
    out = run_ranks(_run, 2, args=(tiny_data, run_dir, async_save, 4), timeout_s=600)
    for res in out:
        assert res["error"] is not None
        assert "rank 1" in res["error"] and "step_00000004" in res["error"], res["error"]
        assert "No space left on device" in res["error"]
    root = tmp_path / "run" / "ckpt"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002"]
    assert (root / "step_00000004.tmp").is_dir() and not (root / "step_00000006.tmp").exists()
    resumed = run_ranks(_run, 2, args=(tiny_data, run_dir, async_save, None, True),
                        timeout_s=600)
    assert resumed[0]["start"] == 2 and resumed[0]["error"] is None
    assert not (root / "step_00000004.tmp").exists()
    assert [p.name for p in complete_checkpoints(root)] == \
        ["step_00000002", "step_00000004", "step_00000006"]
