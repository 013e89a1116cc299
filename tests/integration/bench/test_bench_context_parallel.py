"""The context-parallel benchmark end to end at a toy size: one cp-2 world, both comms'
trainers measured against their plan, and the attention table with torch's context_parallel
timed or its error reported (on CPU it raises; the benchmark runs on)."""
from __future__ import annotations

import argparse

import pytest

from megalite_bench import context_parallel


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_cp_toy(tiny_data):
    parser = argparse.ArgumentParser()
    context_parallel.add_arguments(parser)
    args = parser.parse_args(["--cp", "2", "--seq-len", "64", "--steps", "1", "--warmup", "1",
                              "--model", "n_layer=1", "vocab_size=1024",
                              "--data", str(tiny_data)])
    out = context_parallel.run(args)
    assert [(r["cp"], r["comm"]) for r in out["memory"]] == [(2, "allgather"), (2, "ring")]
    for r in out["memory"]:
        assert 0.9 < r["measured"] / r["planned"] < 1.1 and r["tokens_per_s"] > 0
    kernels = {k["name"]: k for k in out["attention"]}
    assert kernels["megalite allgather"]["seconds"] > 0 and kernels["megalite ring"]["seconds"] > 0
    for name in ("torch context_parallel", "torch context_parallel (MATH)"):
        assert (kernels[name]["seconds"] is None) != (kernels[name]["error"] is None)
