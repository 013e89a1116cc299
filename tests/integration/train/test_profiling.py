"""log.profile_steps: torch.profiler over a window of steps, a trace and a table per rank."""
from __future__ import annotations

import gzip
import json

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT


def _fit(rank, world, tiny_data, run_dir):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "pp=2", "train.max_steps=4", "log.profile_steps=[2,3]", "log.every=2"])
    validate(cfg, world)
    records = build_trainer(cfg, init_runtime(cfg), run_dir).fit()
    return [r["loss"] for r in records]


@pytest.mark.distributed
def test_profiled_window_writes_a_trace_and_a_table_per_rank(tiny_data, tmp_path):
    """Steps 2 and 3, and only they, are in every rank's Chrome trace (with the operators run
    inside them and the pipeline's point-to-point traffic); the table lists operators."""
    losses = run_ranks(_fit, 2, args=(tiny_data, str(tmp_path)), timeout_s=300)
    assert all(loss is not None for loss in losses[1])
    for rank in range(2):
        trace = json.loads(gzip.decompress((tmp_path / "profile" /
                                            f"rank{rank:05d}.json.gz").read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        steps = {n for n in names if n and n.startswith("megalite step")}
        assert steps == {"megalite step 2", "megalite step 3"}, steps
        assert any(n and n.startswith("aten::") for n in names)
        assert any(n and ("send" in n or "recv" in n) for n in names), sorted(names)[:50]
        table = (tmp_path / "profile" / f"rank{rank:05d}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
