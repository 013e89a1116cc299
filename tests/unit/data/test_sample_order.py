"""The sample order at scale ("bijection-v1": a seeded Feistel bijection per epoch, O(1) memory),
the old order ("permutation-v1") kept for checkpoints that count in it, and the loader's bounded
open files and per-stage reads."""
from __future__ import annotations

import json
import resource
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.data.files import ShardFiles, open_descriptors, raise_open_file_limit
from megalite.data.loader import META_FILE, TokenShards, TrainBatches
from megalite.data.order import BijectionOrder, PermutationOrder
from megalite.data.sampler import BlendedSampler, ResumableSampler

SMALL_SIZES = [1, 2, 3, 5, 8, 13, 100, 1000, 1023, 1024, 1025, 4099]  # powers of two and not


def test_bijection_is_a_fresh_permutation_every_epoch():
    for n in SMALL_SIZES:
        windows = BijectionOrder(n, seed=11).windows(np.arange(3 * n))
        epochs = windows.reshape(3, n)
        for e in range(3):
            assert np.array_equal(np.sort(epochs[e]), np.arange(n)), (n, e)  # each window once
        if n >= 8:
            assert not np.array_equal(epochs[0], epochs[1]), n
    order = BijectionOrder(1000, seed=11).windows(np.arange(1000))
    assert not np.array_equal(order, np.arange(1000))  # shuffled: not the identity
    assert abs(np.corrcoef(order, np.arange(1000))[0, 1]) < 0.2
    # position by position equals a whole epoch at once
    one_by_one = [BijectionOrder(1025, seed=11)[p] for p in range(1020, 1030)]
    assert one_by_one == BijectionOrder(1025, seed=11).windows(np.arange(1020, 1030)).tolist()


def test_bijection_is_fixed_by_the_seed():
    a = BijectionOrder(5000, seed=3).windows(np.arange(12_000))
    assert np.array_equal(a, BijectionOrder(5000, seed=3).windows(np.arange(12_000)))
    assert not np.array_equal(a, BijectionOrder(5000, seed=4).windows(np.arange(12_000)))


def _serial_windows(sampler, steps):
    return [sampler.next_samples() for _ in range(steps)]


@pytest.mark.parametrize("order", ["bijection-v1", "permutation-v1"])
def test_resumes_mid_epoch_and_across_epochs_under_another_dp(order):
    """50 windows, 12 per step: 10 steps are 2.4 epochs. Stop at step 3 (mid-epoch) under
    dp 2, resume under dp 3 to step 6 (past an epoch), then dp 4: the ranks' slices, put
    together, are the serial run's batches."""
    serial = _serial_windows(ResumableSampler(50, 12, 0, 1, seed=5, order=order), 10)
    state, got = None, []
    for dp, steps in ((2, 3), (3, 3), (4, 4)):
        ranks = [ResumableSampler(50, 12, d, dp, seed=5, order=order) for d in range(dp)]
        for r in ranks:
            if state is not None:
                r.load_state_dict(state)
        for _ in range(steps):
            got.append(sum((r.next_samples() for r in ranks), []))
        state = ranks[0].state_dict()
        assert all(r.state_dict() == state for r in ranks) and state["order"] == order
    assert got == serial


def test_a_state_written_in_the_old_order_continues_it():
    """A checkpoint from before "bijection-v1" has no order name: its position continues in
    the permutation order, exactly where it stopped, and is saved again under its name."""
    n, seed = 40, 9
    old = np.concatenate([np.random.default_rng(seed + e).permutation(n) for e in range(3)])
    sampler = ResumableSampler(n, 8, 1, 2, seed=seed)  # a new run would count in the bijection
    assert sampler.state_dict()["order"] == "bijection-v1"
    sampler.load_state_dict({"consumed_samples": 32})
    for step in range(6):  # positions 32..79, through the epoch boundary at 40
        first = 32 + 8 * step + 4  # DP rank 1 takes the second half of each batch
        assert sampler.next_global_batch().tolist() == old[first:first + 4].tolist()
    assert sampler.state_dict() == {"consumed_samples": 80, "order": "permutation-v1"}

    blend = BlendedSampler([30, 7], [0.6, 0.4], 10, 0, 1, seed=seed)
    blend.load_state_dict({"consumed_samples": 20, "counts": [12, 8]})
    pairs = blend.next_samples()
    perms = [np.concatenate([np.random.default_rng(seed + 1_000_003 * d + e).permutation(m)
                             for e in range(3)]) for d, m in enumerate([30, 7])]
    taken = [12, 8]
    for d, w in pairs:
        assert w == perms[d][taken[d]]
        taken[d] += 1
    assert blend.state_dict()["order"] == "permutation-v1"


def _peak_traced_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_billion_windows_in_bounded_memory():
    """Metadata only: 1e9 windows (~1T tokens at seq_len 1024), a global batch of 512 over 8 DP
    ranks, drawn at the start, mid-epoch and across the epoch boundary, and a blend with a
    3e8-window dataset. The measure does see numpy allocations: the old order's permutation of
    1e7 windows shows up (80 MB)."""
    n, mib = 10**9, 2**20

    def draw():
        for consumed in (0, n // 2 + 3, n - 100):
            sampler = ResumableSampler(n, 512, 3, 8, seed=1, consumed_samples=consumed)
            for _ in range(3):
                windows = sampler.next_global_batch()
                assert len(np.unique(windows)) == 64 and 0 <= windows.min() < windows.max() < n
        blend = BlendedSampler([n, 3 * 10**8], [0.7, 0.3], 512, 3, 8, seed=1)
        for _ in range(3):
            blend.next_samples()

    assert _peak_traced_bytes(draw) < 50 * mib
    assert _peak_traced_bytes(lambda: PermutationOrder(10**7, 1).windows(np.arange(8))) \
        > 75 * mib


def test_blends_keep_their_proportions_in_the_new_order():
    sizes, weights = [7, 40, 1000], [0.2, 0.3, 0.5]
    sampler = BlendedSampler(sizes, weights, 20, 0, 1, seed=2)
    pairs = [p for _ in range(50) for p in sampler.next_samples()]  # 1000 positions
    counts = np.bincount([d for d, _ in pairs], minlength=3)
    assert np.all(np.abs(counts - 1000 * np.array(weights)) < 1.0)
    for d, m in enumerate(sizes[:2]):  # the small datasets wrap: each epoch a permutation
        seq = [w for k, w in pairs if k == d]
        for e in range(len(seq) // m):
            assert sorted(seq[e * m:(e + 1) * m]) == list(range(m)), (d, e)
    big = [w for k, w in pairs if k == 2]
    assert len(set(big)) == len(big) == 500  # within one epoch: no window twice


@pytest.fixture
def many_shards(tmp_path) -> Path:
    """300 shards of 21 tokens (5 windows of 4 + 1 each): token value = stream position."""
    path = tmp_path / "d"
    path.mkdir()
    entries = []
    for k in range(300):
        (np.arange(k * 21, (k + 1) * 21) % 60000).astype(np.uint16).tofile(path / f"t{k}.bin")
        entries.append({"file": f"t{k}.bin", "tokens": 21})
    split = {"shards": entries, "tokens": 300 * 21, "documents": 1}
    (path / META_FILE).write_text(json.dumps({
        "format_version": 1, "vocab_size": 60001, "eos_token_id": 0, "dtype": "uint16",
        "splits": {"train": split, "val": split}}))
    return path


def test_shards_are_read_with_a_bounded_number_of_open_files(many_shards):
    before = open_descriptors()
    files = ShardFiles(capacity=8)
    shards = TokenShards(many_shards, "train", files)
    assert open_descriptors() == before  # nothing opened up front
    assert shards.num_samples(4) == 1500
    rng = np.random.default_rng(0)
    for _ in range(20):
        indices = rng.choice(1500, size=64, replace=False)
        got = shards.samples(indices, 4)
        shard, k = np.divmod(indices, 5)
        first = shard * 21 + 4 * k  # window k of its shard, in the stream
        assert np.array_equal(got, (first[:, None] + np.arange(5)) % 60000)
        assert files.open_count <= 8 and open_descriptors() - before <= 8
    files.close()
    assert open_descriptors() == before


def test_each_pipeline_stage_reads_only_what_it_consumes(many_shards):
    """First stage: inputs, last stage: targets, a middle stage: no token at all; the sampler
    advances alike on every rank."""
    cpu = torch.device("cpu")
    results = {}
    for reads in [(True, True), (True, False), (False, True), (False, False)]:
        files = ShardFiles(4)
        sampler = ResumableSampler(1500, 8, 0, 1, seed=0)
        batches = TrainBatches([TokenShards(many_shards, "train", files)], sampler, 2, 4, cpu,
                               reads=reads)
        results[reads] = [batches.next_step() for _ in range(3)]
        assert sampler.consumed_samples == 24 and all(len(s) == 4 for s in results[reads])
        assert (files.bytes_read == 0) == (reads == (False, False))
    full = results[(True, True)]
    for reads, steps in results.items():
        for step, full_step in zip(steps, full):
            for (x, y), (fx, fy) in zip(step, full_step):
                assert (x is None) != reads[0] and (y is None) != reads[1]
                assert x is None or torch.equal(x, fx)
                assert y is None or torch.equal(y, fy)


def test_the_soft_open_file_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 512) if hard == resource.RLIM_INFINITY else min(soft, hard // 2, 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        before, after = raise_open_file_limit()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert before == lowered and after == now > lowered
        assert now == hard or hard == resource.RLIM_INFINITY
        assert raise_open_file_limit() == (now, now)  # already at the hard limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
