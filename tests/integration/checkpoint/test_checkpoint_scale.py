"""Checkpoints at scale, shown on a few gloo ranks: the protocol's collectives run on their own
gloo group with `checkpoint.timeout_s` (a writer slower than `parallel.timeout_s` still
publishes), replicated state is written by every DP replica (zero 0: each rank's file is 1/dp),
and a resume under another layout reads and verifies about its own share of the bytes."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import save as ckpt_save
from megalite.checkpoint.format import KINDS, read_global_state, read_meta
from megalite.checkpoint.load import load_checkpoint
from megalite.checkpoint.resolve import latest_checkpoint
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

BLOCK = 4096  # bytes per CRC block in these tests (1 MiB in a run): files span many blocks


def _trainer(tiny_data, run_dir, world, *extra):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"checkpoint.dir={run_dir}/ckpt", *extra])
    validate(cfg, world)
    return build_trainer(cfg, init_runtime(cfg), Path(run_dir))


def _throttled(rank, world, tiny_data, run_dir, delay_s):
    """Rank 1 writes its files `delay_s` late, longer than parallel.timeout_s."""
    write = ckpt_save._write_rank_files

    def slow(tmp, snap, r):
        if r == 1:
            time.sleep(delay_s)
        return write(tmp, snap, r)

    ckpt_save._write_rank_files = slow
    trainer = _trainer(tiny_data, run_dir, world, "zero=1", "train.max_steps=2",
                       "parallel.timeout_s=5", "checkpoint.timeout_s=120")
    trainer.fit()
    return [p.name for p in (Path(run_dir) / "ckpt").iterdir()]


@pytest.mark.distributed
def test_a_writer_slower_than_the_training_timeout_still_publishes(tiny_data, tmp_path):
    """parallel.timeout_s=5 (every training group, the default one included, as under
    torchrun) with a writer 7 s late: the other rank waits on the checkpoint group
    (checkpoint.timeout_s=120), not on a training group, and the save publishes."""
    for listed in run_ranks(_throttled, 2, args=(tiny_data, str(tmp_path), 7.0),
                            timeout_s=300, group_timeout_s=5):
        assert listed == ["step_00000002"], listed


def _spread_then_reshard(rank, world, tiny_data, run_dir):
    """zero 0 on dp=4 saves; then zero 1 on dp=4 (other owned ranges) loads it."""
    ckpt_save.CRC_BLOCK_BYTES = BLOCK
    _trainer(tiny_data, f"{run_dir}/a", world, "zero=0", "train.max_steps=1").fit()
    path = latest_checkpoint(Path(run_dir) / "a" / "ckpt")
    trainer = _trainer(tiny_data, f"{run_dir}/b", world, "zero=1", "train.max_steps=1")
    share = 4 * len(KINDS) * sum(p.hi - p.lo for p in trainer.engine.state_pieces())
    loaded = load_checkpoint(path, trainer.engine, trainer.cfg, trainer.topo)
    out = {"share": share, "verified": loaded.verified_bytes, "read": loaded.read_bytes,
           "files": len([f for f in loaded.meta["files"] if f.endswith(".bin")]),
           "path": str(path)}
    # a changed TP split (tp 1 -> 2): the rank reads the runs of its own elements, and they
    # are the right ones (its slice of each global tensor)
    trainer = _trainer(tiny_data, f"{run_dir}/c", world, "tp=2", "zero=1", "train.max_steps=1")
    loaded = load_checkpoint(path, trainer.engine, trainer.cfg, trainer.topo)
    full = read_global_state(path)
    c = trainer.topo.coords
    padding = 0
    for piece in trainer.engine.state_pieces():
        want = piece.spec.shard(full[piece.spec.name], c.tp_rank, trainer.topo.tp_size)
        want = want.reshape(-1)[piece.lo:piece.hi]
        assert torch.equal(piece.tensors["param"], want), piece.spec.name
        padding += int((want == 0).sum()) if piece.spec.padded_rows else 0
    out["tp2"] = {"share": 4 * len(KINDS) * sum(p.hi - p.lo for p in
                                                trainer.engine.state_pieces()),
                  "padding": 4 * len(KINDS) * padding, "read": loaded.read_bytes,
                  "verified": loaded.verified_bytes}
    return out


@pytest.mark.distributed
def test_zero0_writes_are_spread_and_a_resharded_resume_reads_its_share(tiny_data, tmp_path):
    results = run_ranks(_spread_then_reshard, 4, args=(tiny_data, str(tmp_path)),
                        timeout_s=300)
    meta = read_meta(Path(results[0]["path"]))
    assert meta["format_version"] == 5
    sizes = [meta["files"][f"rank{r:05d}.bin"]["bytes"] for r in range(4)]
    assert max(sizes) - min(sizes) <= 4 * len(KINDS) * 64, sizes  # 1/4 each, to a few rows
    for res in results:
        assert res["read"] == res["share"], res  # exactly the owned ranges
        # zero 0 wrote what zero 1 owns: the CRC pass reads the rank's own file's blocks only
        assert res["share"] <= res["verified"] <= res["share"] + 2 * BLOCK, res
        assert res["verified"] < 0.5 * sum(sizes), res
        tp2 = res["tp2"]  # all but the vocabulary padding rows, which nobody wrote
        assert tp2["read"] == tp2["share"] - tp2["padding"], res
        # the CRC pass of a column-split (dim 1) matrix reads whole blocks, which interleave
        # both new TP ranks' halves of each row: at most tp_new / tp_old = 2 x the share
        assert tp2["read"] <= tp2["verified"] <= 2 * tp2["share"] + 2 * BLOCK * res["files"], \
            res
