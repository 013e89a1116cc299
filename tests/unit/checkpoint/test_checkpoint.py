"""Checkpoints: resume under any layout, faults (truncated or corrupted files, half-written
checkpoints, NaN steps, stuck peers). Kill-and-restart under torchrun: tests/integration/cli/test_cluster.py;
HF export and generation: tests/integration/checkpoint/test_export.py."""
from __future__ import annotations

import json
import shutil
import zlib

import pytest
import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import meta_crc32, read_global_state, read_meta
from megalite.checkpoint.resolve import complete_checkpoints, latest_checkpoint
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from megalite.train.step_guard import NonFiniteError
from megalite.train.trainer import Trainer
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT


def checkpoint_overrides(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *extra]


def serial_trainer(tiny_data, run_dir, *extra) -> Trainer:
    cfg = load_config(TINY + FP32_NO_DROPOUT + checkpoint_overrides(tiny_data, *extra))
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


@pytest.mark.slow
def test_damaged_checkpoints_are_detected_and_skipped(tiny_data, tmp_path, capsys):
    """A damaged data file or a tampered index is refused by name; resume=auto falls back to
    the previous checkpoint and moves the damaged one (and anything after it) to superseded/;
    unfinished step_N.tmp directories are deleted."""
    root = tmp_path / "ckpt"
    common = (f"checkpoint.dir={root}", "checkpoint.every=2", "train.max_steps=4")
    serial_trainer(tiny_data, tmp_path / "a", *common).fit()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    step4 = root / "step_00000004"
    pristine = tmp_path / "pristine"
    shutil.copytree(step4, pristine)

    def tampered_index(record: dict) -> dict:  # still valid JSON, one offset off
        record["pieces"]["param"][0][4] += 4
        return record

    index = read_meta(step4)["tensors"]["transformer.h.0.attn.c_attn.weight"]["index"]
    damages = {
        "rank00000.bin": lambda b: b[:-100],
        "rank00000.bin ": lambda b: b[:50] + bytes([b[50] ^ 0xFF]) + b[51:],
        "meta.json": lambda b: b[:-10],
        index: lambda b: json.dumps(tampered_index(json.loads(b))).encode(),
    }
    for target, damage in damages.items():
        shutil.rmtree(step4, ignore_errors=True)
        shutil.copytree(pristine, step4)
        (root / "step_00000006.tmp").mkdir()  # half-written checkpoints are never picked
        (root / "step_00000008").mkdir()  # no meta.json: incomplete
        assert latest_checkpoint(root) == step4
        path = step4 / target.strip()
        path.write_bytes(damage(path.read_bytes()))
        with pytest.raises(CheckpointError, match=rf"step_00000004/{target.strip()}"):
            serial_trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={step4}")
        resumed = serial_trainer(tiny_data, tmp_path / "c", *common, "checkpoint.resume=auto")
        assert resumed.step == 2  # fell back to the previous complete checkpoint
        assert "step_00000004 unusable" in capsys.readouterr().err  # megalite.utils.log: stderr
        assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "superseded"]
    assert sorted(p.name[:13] for p in (root / "superseded").iterdir()) == \
        ["step_00000004"] * len(damages) + ["step_00000008"] * len(damages)
    # an index whose own CRC32 was recomputed is still checked: every piece inside its file
    bad = tmp_path / "bad_index"
    shutil.copytree(pristine, bad)
    meta = json.loads((bad / "meta.json").read_text())
    entry = meta["tensors"]["transformer.h.0.attn.c_attn.weight"]
    record = json.loads((bad / entry["index"]).read_text())
    record["pieces"]["exp_avg"][-1][4] = meta["files"][record["pieces"]["exp_avg"][-1][3]]["bytes"]
    raw = json.dumps(record).encode()
    (bad / entry["index"]).write_bytes(raw)
    entry.update(bytes=len(raw), crc32=zlib.crc32(raw))
    meta["meta_crc32"] = meta_crc32(meta)
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not cover it or lie outside their file"):
        read_global_state(bad, "exp_avg")
    shutil.copytree(pristine, step4)
    assert serial_trainer(tiny_data, tmp_path / "d", *common, "checkpoint.resume=auto").step == 4


@pytest.mark.slow
def test_a_run_resumed_from_an_earlier_step_keeps_its_own_checkpoints(tiny_data, tmp_path):
    """Resumed at step 2 while steps 4 and 6 of an abandoned continuation exist: those move to
    superseded/, so keep=1 keeps the resumed run's newest checkpoint and resume=auto picks it."""
    root = tmp_path / "ckpt"
    first = (f"checkpoint.dir={root}", "checkpoint.every=2", "checkpoint.keep=3")
    serial_trainer(tiny_data, tmp_path / "a", *first, "train.max_steps=6").fit()
    again = serial_trainer(tiny_data, tmp_path / "b", f"checkpoint.dir={root}", "checkpoint.every=1",
                     "checkpoint.keep=1", "train.max_steps=4",
                     f"checkpoint.resume={root / 'step_00000002'}")
    assert again.step == 2
    again.fit()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000004"]
    assert read_meta(root / "step_00000004")["consumed_samples"] == 4 * 8
    assert sorted(p.name[:13] for p in (root / "superseded").iterdir()) == \
        ["step_00000004", "step_00000006"]
    assert serial_trainer(tiny_data, tmp_path / "c", f"checkpoint.dir={root}",
                    "checkpoint.resume=auto").step == 4


@pytest.mark.slow
def test_non_finite_steps_are_skipped_counted_and_bounded(tiny_data, tmp_path):
    trainer = serial_trainer(tiny_data, tmp_path / "a", "train.max_steps=6", "train.eval_every=0")
    (model,) = trainer.model.chunks
    real_loss = model.loss
    bad_steps = {2}  # 0-based: the third step gets a NaN loss

    def planted(logits, labels, documents=None):
        loss = real_loss(logits, labels, documents)
        return loss * float("nan") if trainer.step in bad_steps else loss

    model.loss = planted
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
    saved = trainer.save()  # the count survives a resume
    resumed = serial_trainer(tiny_data, tmp_path / "r", f"checkpoint.resume={saved}")
    assert (resumed.step, resumed.skipped_steps) == (6, 1)

    bad_steps.update(range(3, 100))
    trainer.cfg.train.max_bad_steps = 2
    with pytest.raises(NonFiniteError, match="2 steps in a row.*train.max_bad_steps=2"):
        for _ in range(5):
            trainer.train_step()


@pytest.mark.slow
def test_resume_under_another_data_order_is_said(tiny_data, tmp_path, capsys):
    """The sampler's position counts windows of seq_len + 1 tokens in a seed's permutation of
    data.dir: resuming under another seq_len or seed is allowed but warned about."""
    saved = serial_trainer(tiny_data, tmp_path / "a", "train.max_steps=1").save()
    capsys.readouterr()
    serial_trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={saved}")
    assert "differs from the checkpoint" not in capsys.readouterr().err
    serial_trainer(tiny_data, tmp_path / "c", f"checkpoint.resume={saved}", "train.seq_len=16",
             "seed=7")
    err = capsys.readouterr().err
    assert "train.seq_len=16 differs from the checkpoint's 32" in err
    assert "seed=7 differs from the checkpoint's 1234" in err


@pytest.mark.slow
def test_a_failed_cleanup_of_old_checkpoints_keeps_the_run_going(tiny_data, tmp_path,
                                                                  monkeypatch, capsys):
    """Deleting checkpoints beyond `keep` happens after the new one is published: failing
    to is a warning, not a failed save."""
    def busy(path):
        raise OSError(16, "Device or resource busy", str(path))

    from megalite.checkpoint import save

    monkeypatch.setattr(save, "discard", busy)
    root = tmp_path / "ckpt"
    serial_trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=1",
             "checkpoint.keep=1", "train.max_steps=3").fit()
    assert [p.name for p in complete_checkpoints(root)] == \
        ["step_00000001", "step_00000002", "step_00000003"]
    assert "published step_00000002 but could not delete" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_is_checked_before_launch(tiny_data, tmp_path):
    """The checkpoint a run would resume is checked before any process group exists: its
    model shape (the MLP size, however written) and its blend; a checkpoint.dir means its
    newest checkpoint, a directory holding none is refused."""
    from megalite.checkpoint.resolve import check_resume
    from megalite.config.errors import ConfigError

    root = tmp_path / "ckpt"
    serial_trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=2",
             "train.max_steps=4").fit()

    def cfg(*extra):
        return load_config(TINY + FP32_NO_DROPOUT + checkpoint_overrides(tiny_data, *extra))

    check_resume(cfg(f"checkpoint.resume={root}", "model.n_inner=256"))  # = 4 * n_embd
    assert serial_trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={root}",
                    "model.n_inner=256").step == 4
    with pytest.raises(ConfigError, match="model.n_layer=3: checkpoint.resume=.*step_00000004"
                                          r"\) was trained with n_layer=2"):
        check_resume(cfg(f"checkpoint.resume={root}", "model.n_layer=3"))
    with pytest.raises(ConfigError, match="model.n_layer=3"):
        check_resume(cfg(f"checkpoint.dir={root}", "checkpoint.resume=auto", "model.n_layer=3"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds neither a complete checkpoint"):
        check_resume(cfg(f"checkpoint.resume={tmp_path / 'empty'}"))
    other = tmp_path / "other_data"
    shutil.copytree(tiny_data, other)
    with pytest.raises(ConfigError, match="data.blend: .* 1 blended dataset.*this run blends 2"):
        check_resume(cfg(f"checkpoint.resume={root}", f"data.blend=[1,{tiny_data},1,{other}]"))


def test_per_rank_files_are_read_only_under_the_layout_and_rank_order_that_wrote_them():
    """A pp2·dp2 checkpoint written in tp-cp-pp-dp (or before the key: no "rank_order") puts
    rank 1 at pp 1, dp 0; in tp-cp-dp-pp rank 1 is pp 0, dp 1, so its RNG file is another
    coordinate's and is not read (the streams restart as after any layout change)."""
    from megalite.checkpoint.load import same_ranks
    from megalite.parallel.topology import Topology

    written = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "world_size": 4, "rank_order": "tp-cp-pp-dp"}
    before_key = {k: v for k, v in written.items() if k != "rank_order"}
    same = Topology(tp_size=1, pp_size=2, dp_size=2, rank=1)
    other = Topology(tp_size=1, pp_size=2, dp_size=2, rank=1, rank_order="tp-cp-dp-pp")
    assert same_ranks(written, same) and same_ranks(before_key, same)
    assert not same_ranks(written, other) and not same_ranks(before_key, other)
    assert same_ranks({**written, "rank_order": "tp-cp-dp-pp"}, other)
    assert not same_ranks({**written, "dp": 1, "pp": 4}, same)
