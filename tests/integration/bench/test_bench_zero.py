
"""The ZeRO benchmark end to end at a toy size: megalite zero=3 / zero=1 against FSDP2 and
DDP + ZeroRedundancyOptimizer in one 2-rank gloo world (about 10 s on 2 cores)."""
import argparse

import pytest

from megalite_bench import zero


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_zero_toy():
    parser = argparse.ArgumentParser()
    zero.add_arguments(parser)
    args = parser.parse_args(["--dp", "2", "--steps", "2", "--warmup", "1", "--seq-len", "32",
                              "--model", "n_layer=2", "n_embd=64", "vocab_size=1024",
                              "n_positions=64"])
    rows = {r["contender"]: r for r in zero.run(args)}
    assert set(rows) == {"megalite-z3", "fsdp2", "megalite-z1", "ddp+zro"}
    for name, ref in zero.PAIRS:
        r = rows[name]
        assert r["vs"] == ref
        assert r["loss_rel_diff"] < 1e-5  # the same math on the same batches
        assert r["speed_ratio"] > 0 and r["mem_ratio"] > 0
    for r in rows.values():
        assert 0 < r["state_mib"] < r["peak_mib"] and r["step_s"] > 0
    # ZeRO-3 shards parameters and gradients too: less model state than ZeRO-1, on both sides
    assert rows["megalite-z3"]["state_mib"] < rows["megalite-z1"]["state_mib"]
    assert rows["fsdp2"]["state_mib"] < rows["ddp+zro"]["state_mib"]
