
"""The pipeline benchmark at a toy size: megalite's 1F1B and interleaved schedules and
torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B (and the zero-bubble
ones, ZB-V's in the V placement) train the same stages to
the same losses, and the bubbles are fractions."""
from __future__ import annotations

import argparse

import pytest

from megalite_bench import pipeline


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_pipeline_toy():
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    args = parser.parse_args(["--pp", "2", "--micro-batches", "1", "2", "--steps", "2",
                              "--virtual-stages", "1", "2", "--schedule", "auto", "zb-h1", "zb-v",
                              "--warmup", "1", "--n-layer", "4", "--n-embd", "32", "--n-head",
                              "2", "--seq-len", "16", "--micro-batch-size", "2",
                              "--vocab-size", "256"])
    rows = pipeline.run(args)
    assert [(r["pp"], r["v"], r["schedule"], r["m"]) for r in rows] == [
        (2, 1, "1f1b", 1), (2, 1, "1f1b", 2), (2, 1, "zb-h1", 1), (2, 1, "zb-h1", 2),
        (2, 2, "interleaved", 2), (2, 2, "zb-v", 1), (2, 2, "zb-v", 2)]
    for r in rows:
        if r["m"] < 2:
            assert "torch_s" not in r  # Schedule1F1B needs m >= pp
            continue
        assert r["torch_s"] > 0 and r["megalite_s"] > 0
        assert r["rel_diff_first"] < 1e-5 and r["rel_diff_last"] < 1e-4
        assert r["saved_mib"] > 0 and r["torch_saved_mib"] > 0
    assert rows[-3]["blocks"] == rows[-1]["blocks"] == [[1, 1], [1, 1]]
    for r in rows:
        assert 0.0 <= r["bubble"] < 1.0
        assert r["loss_last"] < r["loss_first"]  # the same batch, three AdamW steps


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_pipeline_launch_toy(tiny_data, capsys):
    """megalite-bench pipeline-launch: pretrain's build_trainer and fit at pp 2 (the defaults
    on) side by side with torch's Schedule1F1B over the same stages and batches: one run, the
    same first loss."""
    from megalite_bench import launch_pipeline

    parser = argparse.ArgumentParser()
    launch_pipeline.add_arguments(parser)
    launch_pipeline.run(parser.parse_args([
        "--steps", "2", "--warmup", "1", "--repeats", "1", "--data", str(tiny_data),
        "--overrides", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
        "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4"]))
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0  # megalite's and torch's s/step
    assert float(cells[5]) < 1e-5  # the same first loss
