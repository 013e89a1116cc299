"""A corpus of 2,000 shards trains on 2 ranks whose open-file limit is 256, soft and hard (so
raising the soft limit cannot help; the loader before issue 19 kept a memmap, hence a
descriptor, per shard and died with EMFILE): every rank's open descriptors stay bounded, and
each pipeline stage reads only what it consumes (pp 2 trains to the dp 2 losses)."""
from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.data.files import open_descriptors
from megalite.data.token_arrays import write_token_arrays
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

SHARDS = 2000
SHARD_TOKENS = 40  # one window of train.seq_len=32 (+1) per shard
FD_LIMIT = 256
FD_BOUND = 160  # well under the limit: the rank's own files (~20-60) + the shard budget (64)
STEPS = 3
BATCH = ["train.micro_batch_size=8", "train.global_batch_size=64"]  # > 64 shards per rank


def write_many_shards(path: Path) -> Path:
    """A prepared-data directory (no tokenizer) of SHARDS train shards of random token ids
    below 1024."""
    rng = np.random.default_rng(0)
    return write_token_arrays(path, {split: [rng.integers(0, 1024, SHARD_TOKENS, dtype=np.uint16)
                                             for _ in range(count)]
                                     for split, count in (("train", SHARDS), ("val", 1))},
                              1024, 0, "random token ids")


def _train_with_few_open_files(rank, world, data_dir, run_dir, runs):
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    results = []
    for i, overrides in enumerate(runs):
        cfg = load_config(TINY + FP32_NO_DROPOUT + BATCH + [f"data.dir={data_dir}"] + overrides)
        validate(cfg, world)
        trainer = build_trainer(cfg, init_runtime(cfg), f"{run_dir}/{i}")
        files = trainer.batches.sources[0].files
        descriptors, losses = [open_descriptors()], []
        for _ in range(STEPS):
            loss, _ = trainer.train_step()
            descriptors.append(open_descriptors())
            losses.append(trainer._global_mean(loss))
        results.append({"losses": losses, "descriptors": descriptors,
                        "reads": trainer.batches.reads, "opened": files.opened,
                        "bytes_read": files.bytes_read, "capacity": files.capacity,
                        "limit": resource.getrlimit(resource.RLIMIT_NOFILE)})
        files.close()
    return results


@pytest.mark.distributed
def test_two_thousand_shards_train_under_an_open_file_limit_of_256(tmp_path):
    data = write_many_shards(tmp_path / "data")
    per_rank = run_ranks(_train_with_few_open_files, 2,
                         args=(str(data), str(tmp_path / "runs"), [["zero=1"], ["pp=2"]]),
                         timeout_s=300)
    (dp0, pp0), (dp1, pp1) = per_rank
    for run in (dp0, pp0, dp1, pp1):
        assert run["limit"] == (FD_LIMIT, FD_LIMIT) and run["capacity"] == FD_LIMIT // 4
        # training adds at most the shard budget to what the rank had open after start-up
        assert max(run["descriptors"]) - run["descriptors"][0] <= run["capacity"]
        assert max(run["descriptors"]) < FD_BOUND, run["descriptors"]
        assert run["opened"] > run["capacity"]  # more shards read than held: the LRU evicted
    # dp 2: each rank reads its 32 windows per step; pp 2: the first stage reads the inputs,
    # the last the targets, of all 64 windows (one shard each)
    assert dp0["reads"] == dp1["reads"] == (True, True)
    assert pp0["reads"] == (True, False) and pp1["reads"] == (False, True)
    window_bytes = (32 + 1) * 2
    assert dp0["bytes_read"] == dp1["bytes_read"] == STEPS * 32 * window_bytes
    assert pp0["bytes_read"] == pp1["bytes_read"] == STEPS * 64 * window_bytes
    assert pp1["losses"] == pytest.approx(dp0["losses"], rel=1e-5)
