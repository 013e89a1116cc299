"""Load-balanced CP sharding: every token on exactly one rank at its global position, the
gather order inverted, and the causal work equal on every rank."""
from __future__ import annotations

import pytest
import torch

from megalite.parallel import context_shard


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_once_at_its_global_position(cp):
    seq = 4 * cp
    x = torch.arange(seq) * 10
    mine = [context_shard.shard(x, cp, r, dim=0) for r in range(cp)]
    pos = [context_shard.positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(pos).tolist()) == list(range(seq))
    for r in range(cp):
        assert torch.equal(mine[r], x[pos[r]])
    gathered = torch.cat(mine)
    assert torch.equal(context_shard.unshard(gathered, cp, dim=0), x)
    assert torch.equal(context_shard.reshard(x, cp, dim=0), gathered)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_balanced(cp):
    """Rank r's queries see (number of earlier-or-equal keys) summed: the same on every rank."""
    seq = 2 * cp * 3
    work = {sum(p + 1 for p in context_shard.positions(seq, cp, r).tolist()) for r in range(cp)}
    assert len(work) == 1


def test_a_sequence_not_divisible_by_2cp_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"train.seq_len=10 .*2·cp = 4"):
        context_shard.chunk_len(10, 2)
