"""Checkpoints: resume under any layout, faults (truncated or corrupted files, half-written
checkpoints, NaN steps, stuck peers). Kill-and-restart under torchrun: tests/integration/cli/test_cluster.py;
HF export and generation: tests/integration/checkpoint/test_export.py."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.format import read_global_state, read_meta
from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.resolve import latest_checkpoint
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import RankFailure, run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY, serial_common
from tests.layouts import FP32_NO_DROPOUT, assert_equal, from_step, train_layouts
from tests.unit.checkpoint.test_checkpoint import checkpoint_overrides, serial_trainer

STEPS, SAVE_AT = 10, 5


@pytest.fixture(scope="module")
def serial_run(serial_reference, tiny_data):
    assert serial_common(tiny_data) == checkpoint_overrides(tiny_data)  # the run it is the reference of
    return serial_reference


@pytest.mark.distributed
def test_resume_under_any_layout(tiny_data, tmp_path, serial_run):
    """Written under (tp2, pp2, dp2, zero1) at step 5, resumed under the same layout (bit-exact
    continuation) and under (1,1,1,0), (2,1,2,3), (1,2,2,3): steps 6-10 equal the uninterrupted
    run (losses, norms, every parameter after every step)."""
    root = tmp_path / "ckpt"
    writer = checkpoint_overrides(tiny_data, "tp=2", "pp=2", "zero=1", f"checkpoint.dir={root}")
    (written,) = train_layouts(tmp_path / "w", 8, [writer], steps=STEPS, save_at=SAVE_AT)
    assert_equal(serial_run, written)
    step5 = root / f"step_{SAVE_AT:08d}"
    meta = read_meta(step5)
    assert meta["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "zero": 1, "sp": False,
                              "virtual_stages": 1, "world_size": 8, "ep": 1,
                              "rank_order": "tp-cp-pp-dp"}
    assert meta["consumed_samples"] == SAVE_AT * 8 and meta["adam_step"] == SAVE_AT

    resume = [f"checkpoint.resume={step5}"]
    (same,) = train_layouts(tmp_path / "same", 8, [writer + resume], steps=STEPS - SAVE_AT)
    for rank, (a, b) in enumerate(zip(written, same)):
        assert b["losses"] == a["losses"][SAVE_AT:], rank  # exact: same layout, fp32
        assert b["norms"] == a["norms"][SAVE_AT:], rank

    expected = from_step(serial_run, SAVE_AT)
    (serial_resumed,) = train_layouts(tmp_path / "r1", 1, [checkpoint_overrides(tiny_data, *resume)],
                                      steps=STEPS - SAVE_AT)
    assert_equal(expected, serial_resumed)
    runs = [checkpoint_overrides(tiny_data, "tp=2", "zero=3", *resume),
            checkpoint_overrides(tiny_data, "pp=2", "zero=3", *resume)]
    for ranks in train_layouts(tmp_path / "r4", 4, runs, steps=STEPS - SAVE_AT):
        assert_equal(expected, ranks)


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


def _start_from(rank, world, tiny_data, run_dir, source):
    """A tp=2 run with init_from=`source`: its parameters before training, against the
    checkpoint's; and where it starts."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + checkpoint_overrides(tiny_data, "tp=2", f"init_from={source}"))
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
    trainer = serial_trainer(tiny_data, tmp_path / "a", "train.max_steps=3", f"checkpoint.dir={root}",
                       "log.progress=false")
    trainer.fit()
    for res in run_ranks(_start_from, 2, args=(tiny_data, str(tmp_path / "b"), str(root)),
                         timeout_s=300):
        assert res == {"differ": [], "step": 0, "adam_step": 0, "consumed": 0}, res
    check_init_from(str(root), trainer.cfg.model)
    with pytest.raises(ConfigError, match="model.n_layer=3: init_from=.* n_layer=2"):
        check_init_from(str(root), load_config(TINY + ["model.n_layer=3"]).model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="init_from=.*empty.*neither a transformers model"):
        check_init_from(str(tmp_path / "empty"), trainer.cfg.model)


def _auto_resume(rank, world, tiny_data, root, hide_newest_on):
    """dp=2 zero=1, resume=auto; rank `hide_newest_on` does not see the newest checkpoint in
    its own listing (a node whose view of the shared directory lags)."""
    from megalite.checkpoint import resolve as resume

    if rank == hide_newest_on:
        listed = resume.complete_checkpoints
        resume.complete_checkpoints = lambda path: listed(path)[:-1]
    cfg = load_config(TINY + FP32_NO_DROPOUT + checkpoint_overrides(tiny_data, "zero=1",
                                                       f"checkpoint.dir={root}",
                                                       "checkpoint.resume=auto"))
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), f"{root}/../run")
    return trainer.step, trainer.sampler.consumed_samples, trainer.engine.adam_step()


def _load_own_choice(rank, world, tiny_data, root):
    """Each rank loads a checkpoint of its own choosing: rank 0 step 4, rank 1 step 2."""
    cfg = load_config(TINY + FP32_NO_DROPOUT + checkpoint_overrides(tiny_data, "zero=1"))
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
    serial_trainer(tiny_data, tmp_path / "a", f"checkpoint.dir={root}", "checkpoint.every=2",
             "train.max_steps=4").fit()
    for res in run_ranks(_auto_resume, 2, args=(tiny_data, str(root), 1), timeout_s=300):
        assert res == (4, 4 * 8, 4), res
    for message in run_ranks(_load_own_choice, 2, args=(tiny_data, str(root)), timeout_s=300):
        assert "loading different checkpoints (steps [2, 4])" in message, message
