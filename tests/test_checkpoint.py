"""Checkpoints: resume under any layout, faults (truncated or corrupted files, half-written
checkpoints, NaN steps, stuck peers). Kill-and-restart under torchrun: tests/test_cluster.py;
HF export and generation: tests/test_export.py."""
from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import meta_crc32, read_global_state, read_meta
from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.resolve import complete_checkpoints, latest_checkpoint
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import RankFailure, run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from megalite.train.step_guard import NonFiniteError
from megalite.train.trainer import Trainer
from tests.conftest import TINY, serial_common
from tests.layouts import FP32_NO_DROPOUT, assert_equal, from_step, train_layouts

STEPS, SAVE_AT = 10, 5


def _common(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *extra]


@pytest.fixture(scope="module")
def serial_run(serial_reference, tiny_data):
    assert serial_common(tiny_data) == _common(tiny_data)  # the run it is the reference of
    return serial_reference


@pytest.mark.distributed
def test_resume_under_any_layout(tiny_data, tmp_path, serial_run):
    """Written under (tp2, pp2, dp2, zero1) at step 5, resumed under the same layout (bit-exact
    continuation) and under (1,1,1,0), (2,1,2,3), (1,2,2,3): steps 6-10 equal the uninterrupted
    run (losses, norms, every parameter after every step)."""
    root = tmp_path / "ckpt"
    writer = _common(tiny_data, "tp=2", "pp=2", "zero=1", f"checkpoint.dir={root}")
    (written,) = train_layouts(tmp_path / "w", 8, [writer], steps=STEPS, save_at=SAVE_AT)
    assert_equal(serial_run, written)
    step5 = root / f"step_{SAVE_AT:08d}"
    meta = read_meta(step5)
    assert meta["layout"] == {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "sp": False,
                              "virtual_stages": 1, "world_size": 8}
    assert meta["consumed_samples"] == SAVE_AT * 8 and meta["adam_step"] == SAVE_AT

    resume = [f"checkpoint.resume={step5}"]
    (same,) = train_layouts(tmp_path / "same", 8, [writer + resume], steps=STEPS - SAVE_AT)
    for rank, (a, b) in enumerate(zip(written, same)):
        assert b["losses"] == a["losses"][SAVE_AT:], rank  # exact: same layout, fp32
        assert b["norms"] == a["norms"][SAVE_AT:], rank

    expected = from_step(serial_run, SAVE_AT)
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
    return build_trainer(cfg, init_runtime(cfg), run_dir)


@pytest.mark.slow
def test_damaged_checkpoints_are_detected_and_skipped(tiny_data, tmp_path, capsys):
    """A damaged data file or a tampered index is refused by name; resume=auto falls back to
    the previous checkpoint and moves the damaged one (and anything after it) to superseded/;
    unfinished step_N.tmp directories are deleted."""
    root = tmp_path / "ckpt"
    common = (f"checkpoint.dir={root}", "checkpoint.every=2", "train.max_steps=4")
    _trainer(tiny_data, tmp_path / "a", *common).fit()
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
            _trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={step4}")
        resumed = _trainer(tiny_data, tmp_path / "c", *common, "checkpoint.resume=auto")
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
    assert _trainer(tiny_data, tmp_path / "d", *common, "checkpoint.resume=auto").step == 4


@pytest.mark.slow
def test_a_run_resumed_from_an_earlier_step_keeps_its_own_checkpoints(tiny_data, tmp_path):
    """Resumed at step 2 while steps 4 and 6 of an abandoned continuation exist: those move to
    superseded/, so keep=1 keeps the resumed run's newest checkpoint and resume=auto picks it."""
    root = tmp_path / "ckpt"
    first = (f"checkpoint.dir={root}", "checkpoint.every=2", "checkpoint.keep=3")
    _trainer(tiny_data, tmp_path / "a", *first, "train.max_steps=6").fit()
    again = _trainer(tiny_data, tmp_path / "b", f"checkpoint.dir={root}", "checkpoint.every=1",
                     "checkpoint.keep=1", "train.max_steps=4",
                     f"checkpoint.resume={root / 'step_00000002'}")
    assert again.step == 2
    again.fit()
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000004"]
    assert read_meta(root / "step_00000004")["consumed_samples"] == 4 * 8
    assert sorted(p.name[:13] for p in (root / "superseded").iterdir()) == \
        ["step_00000004", "step_00000006"]
    assert _trainer(tiny_data, tmp_path / "c", f"checkpoint.dir={root}",
                    "checkpoint.resume=auto").step == 4


@pytest.mark.slow
def test_non_finite_steps_are_skipped_counted_and_bounded(tiny_data, tmp_path):
    trainer = _trainer(tiny_data, tmp_path / "a", "train.max_steps=6", "train.eval_every=0")
    (model,) = trainer.model.chunks
    real_loss = model.loss
    bad_steps = {2}  # 0-based: the third step gets a NaN loss

    def planted(logits, labels):
        loss = real_loss(logits, labels)
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
    resumed = _trainer(tiny_data, tmp_path / "r", f"checkpoint.resume={saved}")
    assert (resumed.step, resumed.skipped_steps) == (6, 1)

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


@pytest.mark.distributed
def test_a_stuck_peer_gives_an_error_naming_the_group():
    with pytest.raises(RankFailure, match=r"all_reduce on the tp group \(global ranks \[0, 1\]\)"):
        run_ranks(_stuck_peer, 2, timeout_s=60)


@pytest.mark.slow
def test_resume_under_another_data_order_is_said(tiny_data, tmp_path, capsys):
    """The sampler's position counts windows of seq_len + 1 tokens in a seed's permutation of
    data.dir: resuming under another seq_len or seed is allowed but warned about."""
    saved = _trainer(tiny_data, tmp_path / "a", "train.max_steps=1").save()
    capsys.readouterr()
    _trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={saved}")
    assert "differs from the checkpoint" not in capsys.readouterr().err
    _trainer(tiny_data, tmp_path / "c", f"checkpoint.resume={saved}", "train.seq_len=16",
             "seed=7")
    err = capsys.readouterr().err
    assert "train.seq_len=16 differs from the checkpoint's 32" in err
    assert "seed=7 differs from the checkpoint's 1234" in err


def _start_from(rank, world, tiny_data, run_dir, source):
    """A tp=2 run with init_from=`source`: its parameters before training, against the
    checkpoint's; and where it starts."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, "tp=2", f"init_from={source}"))
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    state = read_global_state(latest_checkpoint(Path(source)))
    c = trainer.topo.coords
    differ = [name for name, p in trainer.model.named_parameters()
              if not torch.equal(p.detach(), trainer.model.param_specs[name].shard(
                  state[trainer.model.param_specs[name].name], c.tp_rank, trainer.topo.tp_size))]
    return {"differ": differ, "step": trainer.step, "adam_step": trainer.engine.adam_step(),
            "consumed": trainer.sampler.consumed_samples}


@pytest.mark.distributed
def test_init_from_a_megalite_checkpoint_takes_the_weights_only(tiny_data, tmp_path):
    """init_from=<checkpoint.dir> (Megatron's --finetune): the latest checkpoint's weights, cut
    for tp=2, and a fresh start (step 0, no AdamW moments, data from the beginning); a model
    shape that does not match is refused before launch, naming the key."""
    from megalite.config.errors import ConfigError
    from megalite.train.init_from import check_init_from

    root = tmp_path / "ckpt"
    trainer = _trainer(tiny_data, tmp_path / "a", "train.max_steps=3", f"checkpoint.dir={root}",
                       "log.progress=false")
    trainer.fit()
    for res in run_ranks(_start_from, 2, args=(tiny_data, str(tmp_path / "b"), str(root)),
                         timeout_s=300):
        assert res == {"differ": [], "step": 0, "adam_step": 0, "consumed": 0}, res
    check_init_from(str(root), trainer.cfg.model)
    with pytest.raises(ConfigError, match="model.n_layer=3: init_from=.* n_layer=2"):
        check_init_from(str(root), load_config(TINY + ["model.n_layer=3"]).model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="init_from=.*empty.*neither a transformers GPT-2"):
        check_init_from(str(tmp_path / "empty"), trainer.cfg.model)


def _auto_resume(rank, world, tiny_data, root, hide_newest_on):
    """dp=2 zero=1, resume=auto; rank `hide_newest_on` does not see the newest checkpoint in
    its own listing (a node whose view of the shared directory lags)."""
    from megalite.checkpoint import resolve as resume

    if rank == hide_newest_on:
        listed = resume.complete_checkpoints
        resume.complete_checkpoints = lambda path: listed(path)[:-1]
    cfg = load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, "zero=1",
                                                       f"checkpoint.dir={root}",
                                                       "checkpoint.resume=auto"))
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), f"{root}/../run")
    return trainer.step, trainer.sampler.consumed_samples, trainer.engine.adam_step()


def _load_own_choice(rank, world, tiny_data, root):
    """Each rank loads a checkpoint of its own choosing: rank 0 step 4, rank 1 step 2."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, "zero=1"))
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), f"{root}/../run")
    try:
        load_checkpoint(Path(root) / f"step_0000000{4 if rank == 0 else 2}", trainer.engine,
                             cfg, trainer.topo)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.distributed
def test_every_rank_resumes_from_the_same_checkpoint(tiny_data, tmp_path):
    """resume=auto takes rank 0's listing on every rank, so a rank that does not yet see the
    newest checkpoint still resumes from it; ranks asked to load different steps refuse
    together, naming them."""
    root = tmp_path / "ckpt"
    _trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=2",
             "train.max_steps=4").fit()
    for res in run_ranks(_auto_resume, 2, args=(tiny_data, str(root), 1), timeout_s=300):
        assert res == (4, 4 * 8, 4), res
    for message in run_ranks(_load_own_choice, 2, args=(tiny_data, str(root)), timeout_s=300):
        assert "loading different checkpoints (steps [2, 4])" in message, message


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
    _trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=1",
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
    _trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=2",
             "train.max_steps=4").fit()

    def cfg(*extra):
        return load_config(TINY + FP32_NO_DROPOUT + _common(tiny_data, *extra))

    check_resume(cfg(f"checkpoint.resume={root}", "model.n_inner=256"))  # = 4 * n_embd
    assert _trainer(tiny_data, tmp_path / "b", f"checkpoint.resume={root}",
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
