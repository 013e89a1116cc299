"""Checkpoints written under context parallelism resume under another cp: written at cp 2
(dp 1, zero 0) and at tp 2 x cp 2 (zero 1: ZeRO's ranges over DP x CP) after step SAVE_AT,
resumed at cp 1 (one rank), at dp 2 and at dp 4; each resumed run's steps equal the
uninterrupted serial run's (losses, grad norms, every parameter after every step, the final
validation loss: rel 1e-5). Every element of every tensor is written by exactly one rank (the
CP ranks holding the same parameters split the writing as DP replicas do)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megalite.checkpoint.format import read_meta
from megalite.checkpoint.index import Index, writer_ranks
from tests.layouts import assert_equal, close, from_step, train_in_process, train_layouts
from tests.unit.checkpoint.test_checkpoint import checkpoint_overrides

STEPS, SAVE_AT = 10, 5  # the serial reference's steps (tests/conftest.py), the one resumed


def _written_once(ckpt: Path) -> None:
    """Each kind of each tensor's TP slice is tiled by its pieces without a gap or overlap,
    and every rank's data file holds some of them."""
    meta = read_meta(ckpt)
    index = Index(ckpt, meta)
    files = set()
    for name in index.names():
        tensor = index.tensor(name)
        numel = int(np.prod(tensor.spec.local_shape(tensor.tp)))
        for kind, pieces in tensor.pieces.items():
            for tp_rank in writer_ranks(tensor.spec, tensor.tp):
                spans = sorted((p.lo, p.hi) for p in pieces if p.tp_rank == tp_rank)
                ends = [lo for lo, _ in spans[1:]] + [numel]
                assert spans[0][0] == 0 and [hi for _, hi in spans] == ends, \
                    (name, kind, tp_rank, spans)
                files |= {p.file for p in pieces}
    ranks = meta["layout"]["world_size"]
    assert files == {f"rank{r:05d}.bin" for r in range(ranks)}, sorted(files)


def _check_writer(serial: dict, ranks: list) -> None:
    """The writer's steps up to the checkpoint equal the serial run's."""
    for res in ranks:
        for s in range(SAVE_AT):
            assert close(serial["losses"][s], res["losses"][s], 1e-5), (s, res["losses"])
            assert close(serial["norms"][s], res["norms"][s], 1e-5), (s, res["norms"])


@pytest.mark.distributed
def test_cp_checkpoints_resume_under_another_cp(tiny_data, tmp_path, serial_reference):
    expected = from_step(serial_reference, SAVE_AT)
    runs = {}
    for world, writer, targets in (
            (2, ["cp=2"], [["zero=0"]]),
            (4, ["tp=2", "cp=2", "zero=1"], [["zero=1"]])):
        root = tmp_path / f"cp-w{world}"
        saved = root / f"step_{SAVE_AT:08d}"
        configs = [checkpoint_overrides(tiny_data, *writer, f"checkpoint.dir={root}")]
        configs += [checkpoint_overrides(tiny_data, *t, f"checkpoint.resume={saved}")
                    for t in targets]
        # the writer trains to SAVE_AT and saves; then, in the same ranks, the resumes
        written, *resumed = train_layouts(tmp_path / f"w{world}", world, configs,
                                          steps=SAVE_AT, save_at=SAVE_AT)
        _check_writer(serial_reference, written)
        assert read_meta(saved)["layout"]["cp"] == 2
        _written_once(saved)
        runs[world] = (saved, resumed)
    for world, (_, resumed) in runs.items():
        for ranks in resumed:
            assert_equal(expected, ranks)
    serial_resumed = train_in_process(tmp_path / "cp1", checkpoint_overrides(
        tiny_data, f"checkpoint.resume={runs[2][0]}"), steps=STEPS - SAVE_AT)
    assert_equal(expected, [serial_resumed])
