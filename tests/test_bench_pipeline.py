"""The pipeline benchmark at a toy size: megalite's 1F1B and torch.distributed.pipelining's
Schedule1F1B train the same stages to the same losses, and the bubbles are fractions."""
from __future__ import annotations

import argparse

from megalite.bench import pipeline


def test_bench_pipeline_toy():
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    args = parser.parse_args(["--pp", "2", "--micro-batches", "1", "2", "--steps", "2",
                              "--warmup", "1", "--n-layer", "2", "--n-embd", "32", "--n-head",
                              "2", "--seq-len", "16", "--micro-batch-size", "2",
                              "--vocab-size", "256"])
    rows = pipeline.run(args)
    assert [(r["pp"], r["m"]) for r in rows] == [(2, 1), (2, 2)]
    assert "torch_s" not in rows[0]  # Schedule1F1B needs m >= pp
    assert rows[1]["torch_s"] > 0 and rows[1]["megalite_s"] > 0
    assert rows[1]["rel_diff_first"] < 1e-5 and rows[1]["rel_diff_last"] < 1e-4
    for r in rows:
        assert 0.0 <= r["bubble"] < 1.0
        assert r["loss_last"] < r["loss_first"]  # the same batch, three AdamW steps
