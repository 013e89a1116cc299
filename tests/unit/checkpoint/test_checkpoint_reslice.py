"""The range mapping a resume under a changed TP size reads with (checkpoint.reslice), against
cutting the global tensor with ParamSpec.shard directly."""
from __future__ import annotations

import itertools

import pytest
import torch

from megalite.checkpoint.reslice import runs
from megalite.parallel.param_spec import ParamSpec, padded_vocab_size

SPECS = {
    "column [q|k|v]": lambda tp: ParamSpec("c_attn.weight", (24, 8), 0, 3),
    "column bias [q|k|v]": lambda tp: ParamSpec("c_attn.bias", (24,), 0, 3),
    "row": lambda tp: ParamSpec("c_proj.weight", (8, 16), 1),
    "vocab rows, padded": lambda tp: ParamSpec("wte.weight", (300, 4), 0, 1,
                                               padded_vocab_size(300, tp, 8)),
    "replicated": lambda tp: ParamSpec("ln.weight", (8,)),
    "replicated 2-D": lambda tp: ParamSpec("wpe.weight", (5, 4)),
    # 2 KV heads: split at tp <= 2, each shared by tp / 2 ranks at tp = 4 (grouped-query)
    "KV heads shared": lambda tp: ParamSpec("k_proj.weight", (4, 6), 0,
                                            tp_replicas=max(1, tp // 2)),
}


@pytest.mark.parametrize("kind", SPECS)
def test_runs_fill_every_range_from_the_writers_slices(kind):
    full = torch.randn(SPECS[kind](1).shape)
    for old_tp, new_tp in itertools.product((1, 2, 4), repeat=2):
        writer, reader = SPECS[kind](old_tp), SPECS[kind](new_tp)
        written = [writer.shard(full, r, old_tp).reshape(-1) for r in range(old_tp)]
        for rank in range(new_tp):
            want = reader.shard(full, rank, new_tp).reshape(-1)
            n = want.numel()
            for lo, hi in ((0, n), (1, n - 3), (n // 3, n // 2), (n - 1, n)):
                got = torch.zeros(hi - lo)
                covered = 0
                for r in runs(reader, new_tp, rank, writer, old_tp, lo, hi):
                    got[r.dst:r.dst + r.length] = written[r.writer][r.src:r.src + r.length]
                    covered += r.length
                assert torch.equal(got, want[lo:hi]), (kind, old_tp, new_tp, rank, lo, hi)
                # every element read once, padding rows (zero) read from nobody
                assert covered == int((want[lo:hi] != 0).sum())
