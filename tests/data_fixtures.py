"""Prepared corpora the data tests of both tiers share (tests/unit: preparation and loading in
this process; tests/integration: the same under several processes, a killed preparation,
training on a blend), registered as pytest fixtures by tests/conftest.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from transformers import AutoTokenizer

from megalite.config.schema import DataConfig
from megalite.data import prepare as prepare_module
from megalite.data.loader import META_FILE, TokenShards
from megalite.data.prepare import prepare
from megalite.testing.documents import short_documents
from tests.conftest import shard_arrays

PREPARE_BATCH = 16  # documents per tokenized batch in the preparation tests: many manifest commits


@pytest.fixture
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """`load_dataset` of local files writes its Arrow cache under tmp, not ~/.cache. `datasets`
    is imported here, not at the top: conftest registers this module as a plugin, and the CUDA
    tests (`megalite-bench gpu` on a machine with torch but without `datasets`) must collect."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def small_prepare_batches(hf_cache_in_tmp, monkeypatch):
    """The preparation tokenizes PREPARE_BATCH documents at a time (many manifest commits)."""
    monkeypatch.setattr(prepare_module, "DOCS_PER_BATCH", PREPARE_BATCH)


# --- a stdlib corpus (tests/*/*/test_data.py) ---------------------------------------------------

NUM_DOCS = 60
VAL_FRACTION = 0.1


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory) -> Path:
    """60 stdlib files, a trained 512-token BPE, shards small enough to make several per split."""
    out = tmp_path_factory.mktemp("stdlib")
    cfg = DataConfig(dir=str(out), max_documents=NUM_DOCS, tokenizer_vocab_size=512,
                     val_fraction=VAL_FRACTION, num_proc=1, shard_tokens=100_000)
    prepare(cfg, out, progress=False)
    return out


def read_tokens(data_dir: Path, split: str) -> np.ndarray:
    shards = TokenShards(data_dir, split)
    return np.concatenate([np.asarray(s) for s in shard_arrays(shards)] or [np.zeros(0, np.int64)])


def assert_round_trip(data_dir: Path, docs_per_split: Dict[str, List[str]]) -> None:
    """Each split's token stream decodes to its documents, each followed by EOS."""
    tokenizer = AutoTokenizer.from_pretrained(str(data_dir / "tokenizer"))
    meta = json.loads((data_dir / META_FILE).read_text())
    for split, docs in docs_per_split.items():
        tokens = read_tokens(data_dir, split)
        assert meta["splits"][split]["documents"] == len(docs)
        assert meta["splits"][split]["tokens"] == len(tokens)
        assert int((tokens == meta["eos_token_id"]).sum()) == len(docs)
        expected = "".join(d + tokenizer.eos_token for d in docs)
        assert tokenizer.decode(tokens.tolist()) == expected


# --- a made-up jsonl corpus and its tokenizer (tests/*/*/test_prepare_scale.py) ----------------

SHARD_TOKENS = 600


def made_up_documents(n: int) -> list:
    rng = np.random.default_rng(0)
    words = ["data", "model", "token", "shard", "résumé", "pipeline", "<|endoftext|>", "λ"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) if i % 23 else ""
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A jsonl corpus of 400 made-up documents (every 23rd empty) with a second field."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "url": f"u{i}"}) + "\n"
                            for i, t in enumerate(made_up_documents(400))))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus) -> Path:
    """A 300-token byte-level BPE trained locally on the corpus."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    prepare_module.train_tokenizer(iter(texts), 300).save_pretrained(out)
    return out


def json_config(corpus: Path, tokenizer: str, **kw) -> DataConfig:
    return DataConfig(**{"source": "json", "data_files": [str(corpus)], "tokenizer": tokenizer,
                         "val_fraction": 0.1, "num_proc": 1, "shard_tokens": SHARD_TOKENS, **kw})


def shard_bytes(data_dir: Path) -> dict:
    meta = json.loads((data_dir / META_FILE).read_text())
    return {s: b"".join((data_dir / e["file"]).read_bytes() for e in meta["splits"][s]["shards"])
            for s in ("train", "val")}


# --- short documents (the combination matrix, tests/integration/train/test_document_*) -------

@pytest.fixture(scope="session")
def short_document_data(tmp_path_factory) -> Path:
    """40,000 tokens of random documents of 3-20 tokens (`megalite.testing.documents`): every
    32-token window of the matrix's runs holds several."""
    return short_documents(tmp_path_factory.mktemp("short-documents") / "data")


# --- a second prepared directory (tests/*/*/test_blend.py) -------------------------------------

@pytest.fixture(scope="module")
def second_data(tiny_data, tmp_path_factory):
    """A second prepared directory with the same tokenizer (a copy of the first)."""
    copy = tmp_path_factory.mktemp("blend") / "copy"
    shutil.copytree(tiny_data, copy)
    return copy
