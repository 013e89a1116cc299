"""The published-runs table (megalite-bench plan-published) cannot drift silently: a few rows'
predictions against the values stored here when the table was last regenerated
(docs/planner.md), and each within its band of the publication."""
from __future__ import annotations

import pytest

from megalite_bench.plan_published import evaluate, rows

# label -> (schedule, predicted TFLOP/s per GPU) as `megalite-bench plan-published` printed
STORED = {
    "405B 8K, 8,192 GPUs, TP8 CP1 PP16 DP64": ("interleaved v4", 428.6),
    "405B 8K, 16,384 GPUs, TP8 CP1 PP16 DP128": ("interleaved v4", 347.5),
    "GPT 1.7B, 32 GPUs, TP1 PP1": ("1f1b", 129.7),
}


@pytest.mark.parametrize("label", sorted(STORED))
def test_row_matches_stored_prediction_and_band(label):
    row = next(r for r in rows() if r.label == label)
    result = evaluate(row)
    schedule, stored = STORED[label]
    assert result.schedule == schedule
    assert result.tflops == pytest.approx(stored, rel=2e-3)
    assert abs(result.tflops / row.published - 1) <= row.band
