"""Blended datasets (`data.blend`, Megatron's weighted --data-path): the greedy blend keeps every
prefix within one sample of its shares, DP ranks split the serial batches, the position resumes
exactly, blends of different tokenizers are refused, and training on a blend under DP (and
resumed under another layout) equals the serial run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.data.errors import DataError
from megalite.data.loader import check_data
from megalite.data.sampler import BlendedSampler, blend_choices


def test_greedy_blend_tracks_the_weights():
    counts = [0, 0, 0]
    choices = blend_choices([0.5, 0.3, 0.2], counts, 1000)
    assert choices[:10] == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]  # ties go to the first dataset
    assert counts == [500, 300, 200]
    running = np.zeros(3)
    for n, d in enumerate(choices, 1):
        running[d] += 1
        assert np.all(np.abs(running - n * np.array([0.5, 0.3, 0.2])) < 1.0), n
    assert blend_choices([7, 3], [0, 0], 10).count(0) == 7  # weights need not sum to 1


def _take(sampler, steps):
    return [sampler.next_samples() for _ in range(steps)]


def test_blended_sampler_splits_over_dp_resumes_and_cycles_each_dataset():
    sizes, weights = [5, 40], [0.5, 0.5]
    serial = _take(BlendedSampler(sizes, weights, 8, 0, 1, seed=3), 6)
    ranks = [_take(BlendedSampler(sizes, weights, 8, d, 2, seed=3), 6) for d in range(2)]
    for step in range(6):
        assert ranks[0][step] + ranks[1][step] == serial[step]
    flat = [pair for batch in serial for pair in batch]
    small = [i for d, i in flat if d == 0]  # 24 samples of a 5-window dataset: ~5 epochs
    for epoch in range(4):
        assert sorted(small[5 * epoch:5 * epoch + 5]) == list(range(5))
    assert small[:5] != small[5:10]  # a fresh permutation each epoch
    first = BlendedSampler(sizes, weights, 8, 1, 2, seed=3)
    _take(first, 3)
    again = BlendedSampler(sizes, weights, 8, 1, 2, seed=3)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert _take(again, 3) == ranks[1][3:]
    with pytest.raises(DataError, match="for 2 blended datasets, this run blends 3"):
        BlendedSampler([5, 5, 5], [1, 1, 1], 8, 0, 1, seed=3).load_state_dict(first.state_dict())


def test_blend_is_checked_before_launch(tiny_data, second_data, tmp_path):
    check_data([tiny_data, second_data], 32, 16, 1024, evaluates=True)
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    tokenizer = other / "tokenizer" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"unk_token"', '"unk_token" ', 1))
    with pytest.raises(DataError, match="was tokenized with another tokenizer"):
        check_data([tiny_data, other], 32, 16, 1024, evaluates=False)
    with pytest.raises(ConfigError, match="data.blend=.*alternate weights"):
        validate(load_config([f"data.blend=[1,{tiny_data},2]"]), 1)
