"""Checkpoints: resume under any layout, faults (truncated or corrupted files, half-written
checkpoints, NaN steps, stuck peers). Kill-and-restart under torchrun: tests/test_cluster.py;
HF export and generation: tests/test_export.py."""
from __future__ import annotations

import time

import pytest
import torch

from megalite.config import load_config, validate
from megalite.runtime import init_runtime
from megalite.train import checkpoint as ckpt
from megalite.train.trainer import NonFiniteError, Trainer
from tests.conftest import TINY
from megalite.spawn import RankFailure, run_ranks
from tests.layouts import FP32_NO_DROPOUT, assert_equal, train_layout, train_layouts

STEPS, SAVE_AT = 10, 5


def _common(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *extra]


def _from(serial: dict, start: int) -> dict:
    """The serial run seen from step `start` on."""
    return {**serial, "losses": serial["losses"][start:], "norms": serial["norms"][start:],
            "params": serial["params"][start:]}


@pytest.fixture(scope="module")
def serial_run(tiny_data, tmp_path_factory):
    (result,) = train_layout(tmp_path_factory.mktemp("serial"), 1, _common(tiny_data))
    return result


def test_resume_under_any_layout(tiny_data, tmp_path, serial_run):
    """Written under (tp2, pp2, dp2, zero1) at step 5, resumed under the same layout (bit-exact
    continuation) and under (1,1,1,0), (2,1,2,3), (1,2,2,3): steps 6-10 equal the uninterrupted
    run (losses, norms, every parameter after every step)."""
    root = tmp_path / "ckpt"
    writer = _common(tiny_data, "tp=2", "pp=2", "zero=1", f"checkpoint.dir={root}")
    (written,) = train_layouts(tmp_path / "w", 8, [writer], steps=STEPS, save_at=SAVE_AT)
    assert_equal(serial_run, written)
    step5 = root / f"step_{SAVE_AT:08d}"
    meta = ckpt.read_meta(step5)
    assert meta["layout"] == {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "sp": False, "world_size": 8}
    assert meta["consumed_samples"] == SAVE_AT * 8 and meta["adam_step"] == SAVE_AT

    resume = [f"checkpoint.resume={step5}"]
    (same,) = train_layouts(tmp_path / "same", 8, [writer + resume], steps=STEPS - SAVE_AT)
    for rank, (a, b) in enumerate(zip(written, same)):
        assert b["losses"] == a["losses"][SAVE_AT:], rank  # exact: same layout, fp32
        assert b["norms"] == a["norms"][SAVE_AT:], rank

    expected = _from(serial_run, SAVE_AT)
    (serial_resumed,) = train_layouts(tmp_path / "r1", 1, [_common(tiny_data, *resume)],
                                      steps=STEPS - SAVE_AT)
    assert_equal(expected, serial_resumed)
    for ranks in train_layouts(tmp_path / "r4", 4, [_common(tiny_data, "tp=2", "zero=3", *resume),
                                                    _common(tiny_data, "pp=2", "zero=3", *resume)],
                               steps=STEPS - SAVE_AT):
        assert_equal(expected, ranks)


def _trainer(tiny_data, run_dir, *extra) -> Trainer:
    cfg = load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, *extra))
    validate(cfg, 1)
    return Trainer(cfg, init_runtime(cfg), run_dir)


def test_damaged_checkpoints_are_detected_and_skipped(tiny_data, tmp_path, capsys):
    root = tmp_path / "ckpt"
    common = (f"checkpoint.dir={root}", "checkpoint.every=2", "train.max_steps=4")
    _trainer(tiny_data, tmp_path / "a", *common).fit()
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    # half-written checkpoints are never picked
    (root / "step_00000006.tmp").mkdir()
    (root / "step_00000008").mkdir()  # no meta.json: incomplete
    assert ckpt.latest_checkpoint(root).name == "step_00000004"

    data = root / "step_00000004" / "rank00000.bin"
    original = data.read_bytes()
    for damage in ("truncate", "flip"):
        data.write_bytes(original[:-100] if damage == "truncate"
                         else original[:50] + bytes([original[50] ^ 0xFF]) + original[51:])
        with pytest.raises(ckpt.CheckpointError, match=r"step_00000004/rank00000.bin"):
            _trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={root / 'step_00000004'}")
        resumed = _trainer(tiny_data, tmp_path / "c", *common, "checkpoint.resume=auto")
        assert resumed.step == 2  # fell back to the previous complete checkpoint
        assert "step_00000004 unusable" in capsys.readouterr().out
    data.write_bytes(original)
    assert _trainer(tiny_data, tmp_path / "d", *common, "checkpoint.resume=auto").step == 4


def test_non_finite_steps_are_skipped_counted_and_bounded(tiny_data, tmp_path):
    trainer = _trainer(tiny_data, tmp_path / "a", "train.max_steps=6", "train.eval_every=0")
    real_loss = trainer.model.loss
    bad_steps = {2}  # 0-based: the third step gets a NaN loss

    def planted(logits, labels):
        loss = real_loss(logits, labels)
        return loss * float("nan") if trainer.step in bad_steps else loss

    trainer.model.loss = planted
    before = None
    records = []
    for _ in range(6):
        if trainer.step == 2:
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        loss, norm = trainer.train_step()
        records.append((trainer.step, loss, norm))
        if trainer.step == 3:  # the NaN step left every parameter unchanged
            for n, p in trainer.model.named_parameters():
                assert torch.equal(p, before[n]), n
    assert records[2][1] is None and records[2][2] != records[2][2]  # skipped, norm NaN
    assert all(loss is not None for _, loss, _ in records[:2] + records[3:])
    assert trainer.skipped_steps == 1

    bad_steps.update(range(3, 100))
    trainer.cfg.train.max_bad_steps = 2
    with pytest.raises(NonFiniteError, match="2 steps in a row.*train.max_bad_steps=2"):
        for _ in range(5):
            trainer.train_step()


def _stuck_peer(rank, world):
    from megalite.parallel import comm
    from megalite.parallel.topology import build_topology

    topo = build_topology(world, 1, 1, timeout_s=3)
    if rank == 1:
        time.sleep(8)  # never joins: rank 0 must not wait forever
        return "slept"
    comm.all_reduce(torch.ones(4), topo.tp_group)


def test_a_stuck_peer_gives_an_error_naming_the_group():
    with pytest.raises(RankFailure, match=r"all_reduce on the tp group \(global ranks \[0, 1\]\)"):
        run_ranks(_stuck_peer, 2, timeout_s=60)
