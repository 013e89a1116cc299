"""A serial run under train.attention_mask=document on short documents: every micro-batch
carries its documents (training and validation), the metrics line reports the attention FLOPs
computed within documents beside the dense count MFU keeps, and the header says which MFU
counts; a corpus without an EOS id is refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.data.errors import DataError
from megalite.testing.documents import short_documents
from megalite.train.build import build_trainer
from megalite.train.preflight import preflight
from megalite.train.runtime import init_runtime
from megalite.train.selftest import release
from tests.conftest import TINY

DOCUMENT = ["train.attention_mask=document", "train.eos_loss=false", "log.peak_tflops=1",
            "train.max_steps=1", "train.eval_every=1", "log.every=1"]


def _trainer(data, run_dir, *overrides):
    cfg = load_config(TINY + [f"data.dir={data}", *overrides])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


def causal_pairs(tokens: torch.Tensor, eos: int = 0) -> int:
    """Σ over each window's documents of n(n+1)/2, counted token by token."""
    pairs = 0
    for row in tokens.tolist():
        n = 0
        for token in row:
            n += 1
            pairs += n  # this token sees the n tokens of its document up to itself
            if token == eos:
                n = 0
    return pairs


def test_the_masked_attention_flops_are_logged_beside_the_dense_count(tmp_path):
    data = short_documents(tmp_path / "data")
    trainer = _trainer(data, tmp_path / "run", *DOCUMENT)
    try:
        (record,) = trainer.fit()
        batches = trainer.last_micro_batches
        assert all(len(mb) == 3 and mb[2].ids is not None for mb in batches)
        assert all(len(mb) == 3 for mb in trainer.val_batches())
        m, t = trainer.cfg.model, trainer.cfg.train
        per_pair = 12 * m.n_layer * m.n_embd
        expected = sum(causal_pairs(x) for x, _, _ in batches)
        assert record["attention_flops_masked"] == per_pair * expected
        assert record["attention_flops_in_mfu"] == per_pair * t.seq_len ** 2 * t.global_batch_size
        assert record["attention_flops_masked"] < record["attention_flops_in_mfu"] / 4
        assert record["val_loss"] is not None and np.isfinite(record["val_loss"])
        header = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
        assert header["run"]["attention_mask"] == "document"
        assert "attention_flops_masked" in header["run"]["mfu_attention_flops"]
    finally:
        release(trainer.rt)


def test_a_corpus_without_an_eos_id_is_refused_by_name(tmp_path):
    data = short_documents(tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    meta.pop("eos_token_id")
    (data / "meta.json").write_text(json.dumps(meta))
    cfg = load_config(TINY + [f"data.dir={data}", *DOCUMENT])
    with pytest.raises(DataError, match="eos_token_id.*train.attention_mask=document"):
        preflight(cfg, 1)  # before any process group exists
    assert not dist.is_initialized()
    preflight(load_config(TINY + [f"data.dir={data}"]), 1)  # the defaults need no EOS
