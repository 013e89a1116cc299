"""Data pipeline: prepare (stdlib, json, text), shards, the resumable sampler and the batches."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from megalite.config.schema import DataConfig
from megalite.data.errors import DataError
from megalite.data.loader import (
    META_FILE,
    TokenShards,
    TrainBatches,
    check_data,
    check_vocab,
    token_dtype,
    val_batches,
)
from megalite.data.prepare import EOS_TOKEN, prepare, split_documents
from megalite.data.sampler import ResumableSampler
from megalite.data.sources import stdlib_files
from megalite.data.writer import ShardWriter
from tests.conftest import shard_arrays
from tests.data_fixtures import NUM_DOCS, VAL_FRACTION, assert_round_trip

pytestmark = pytest.mark.usefixtures("hf_cache_in_tmp")


@pytest.mark.slow
def test_stdlib_prepare_meta_and_round_trip(stdlib_data):
    meta = json.loads((stdlib_data / META_FILE).read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(stdlib_data / "tokenizer"))
    assert meta["format_version"] == 2 and meta["dtype"] == "uint16"
    assert meta["split"]["method"] == "hash-v1" and meta["split"]["documents_read"] == NUM_DOCS
    assert meta["vocab_size"] == len(tokenizer) == 512
    assert meta["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert meta["tokenizer"] == {"name": "trained byte-level BPE", "dir": "tokenizer"}
    assert meta["source"] == {"source": "stdlib", "config_name": None, "revision": None,
                              "split": "train", "data_files": None, "text_field": "text",
                              "max_documents": NUM_DOCS}
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == NUM_DOCS
    for split in ("train", "val"):
        shards = meta["splits"][split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}_{i:05d}.bin" for i in range(len(shards))]
        assert all(0 < s["tokens"] <= 100_000 for s in shards)
        assert sum(s["tokens"] for s in shards) == meta["splits"][split]["tokens"]
    assert len(meta["splits"]["train"]["shards"]) > 1
    assert not list(stdlib_data.parent.glob("*.tmp")) and not list(stdlib_data.glob("*.partial"))
    assert not (stdlib_data / "progress.json").exists()

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()[:NUM_DOCS]]
    splits = split_documents(NUM_DOCS, VAL_FRACTION)
    assert 0 < len(splits["val"]) < NUM_DOCS // 2
    assert sorted(np.concatenate(list(splits.values()))) == list(range(NUM_DOCS))
    assert_round_trip(stdlib_data, {s: [texts[i] for i in idx] for s, idx in splits.items()})


def test_split_is_a_function_of_the_document_index():
    """Format 2: a document's split depends on its index alone, so any prefix of a corpus is
    split as the whole is; the validation share follows val_fraction."""
    big = split_documents(200_000, 0.01)
    small = split_documents(1000, 0.01)
    assert np.array_equal(small["val"], big["val"][big["val"] < 1000])
    assert abs(len(big["val"]) / 200_000 - 0.01) < 0.001
    assert sorted(np.concatenate([big["train"], big["val"]])) == list(range(200_000))
    assert len(split_documents(100, 0.0)["val"]) == 0


def test_json_source_with_a_saved_tokenizer_directory(stdlib_data, tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i}  # é\n" * (i % 3 + 1) for i in range(30)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    out = tmp_path / "json_data"
    cfg = DataConfig(source="json", data_files=[str(path)], text_field="content",
                     tokenizer=str(stdlib_data / "tokenizer"), val_fraction=0.2, num_proc=1)
    meta = prepare(cfg, out, progress=False)
    assert meta["tokenizer"]["name"] == str(stdlib_data / "tokenizer")
    assert meta["vocab_size"] == 512 and meta["source"]["data_files"] == [str(path)]
    splits = split_documents(len(docs), 0.2)
    assert_round_trip(out, {s: [docs[i] for i in idx] for s, idx in splits.items()})

    with pytest.raises(DataError, match=r"data.text_field='body'.*\['content', 'id'\]"):
        prepare(DataConfig(source="json", data_files=[str(path)], text_field="body",
                           tokenizer=str(stdlib_data / "tokenizer"), num_proc=1),
                tmp_path / "bad", progress=False)


def test_bad_data_settings_name_the_key(tmp_path):
    with pytest.raises(DataError, match="data.val_fraction=1.5"):
        prepare(DataConfig(val_fraction=1.5), tmp_path / "x", progress=False)
    with pytest.raises(DataError, match="data.tokenizer_vocab_size=100"):
        prepare(DataConfig(tokenizer_vocab_size=100), tmp_path / "x", progress=False)
    with pytest.raises(DataError, match="data.data_files"):
        prepare(DataConfig(source="json", data_files=[str(tmp_path / "none.jsonl")]),
                tmp_path / "x", progress=False)
    (tmp_path / "empty_tokenizer").mkdir()
    with pytest.raises(DataError, match="data.tokenizer=.*empty_tokenizer.*cannot load it"):
        prepare(DataConfig(tokenizer=str(tmp_path / "empty_tokenizer")), tmp_path / "x",
                progress=False)
    assert not (tmp_path / "x").exists()


def test_dtype_fits_the_vocabulary():
    assert token_dtype(512) == np.uint16
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(128256) == np.uint32


def make_data_dir(path: Path, tokens: Dict[str, np.ndarray], shard_tokens: int,
                  vocab_size: int = 100) -> Path:
    """A hand-made data directory in the prepare format (no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    splits = {}
    for split, stream in tokens.items():
        writer = ShardWriter(path, split, dtype, shard_tokens)
        writer.write(stream)
        splits[split] = {"shards": writer.close(), "tokens": len(stream), "documents": 1}
    meta = {"format_version": 1, "vocab_size": vocab_size, "eos_token_id": 0,
            "dtype": dtype.name, "splits": splits}
    (path / META_FILE).write_text(json.dumps(meta))
    return path


def test_windows_never_cross_shard_boundaries(tmp_path):
    data = make_data_dir(tmp_path / "d", {"train": np.arange(25), "val": np.arange(7)}, 10)
    shards = TokenShards(data, "train")
    assert [len(s) for s in shard_arrays(shards)] == [10, 10, 5]
    assert shards.num_samples(3) == 3 + 3 + 1
    assert shards.sample(0, 3).tolist() == [0, 1, 2, 3]
    assert shards.sample(2, 3).tolist() == [6, 7, 8, 9]
    assert shards.sample(3, 3).tolist() == [10, 11, 12, 13]
    assert shards.sample(6, 3).tolist() == [20, 21, 22, 23]
    assert shards.sample(6, 3).dtype == np.int64
    with pytest.raises(IndexError):
        shards.sample(7, 3)
    assert shards.num_samples(9) == 2 and shards.num_samples(10) == 0


def test_uint32_shards_keep_large_ids(tmp_path):
    stream = np.array([0, 70000, 128255, 5, 65536], dtype=np.int64)
    data = make_data_dir(tmp_path / "d", {"train": stream, "val": stream}, 3, vocab_size=128256)
    shards = TokenShards(data, "train")
    assert shards.dtype == np.uint32 and shards.meta["dtype"] == "uint32"
    assert np.concatenate([np.asarray(s) for s in shard_arrays(shards)]).tolist() == stream.tolist()


def test_unprepared_data_names_the_command_that_prepares_it(tmp_path):
    """data=wikitext not prepared: the refusal gives `megalite-prepare data=wikitext` and its
    directory (`data.dir=<dir>` alone would prepare the default corpus there)."""
    from megalite.config.schema import load_config
    from megalite.train.preflight import preflight

    missing = tmp_path / "wiki"
    cfg = load_config(["data=wikitext", f"data.dir={missing}"])
    with pytest.raises(DataError, match=r"no such directory; run `megalite-prepare "
                       rf"data=wikitext data.dir={missing}` \(with this run's other data"):
        preflight(cfg, 1)


def test_shard_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"data.dir=.*nowhere.*no such directory.*prepare_data.py"):
        TokenShards(tmp_path / "nowhere", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no meta.json.*prepare_data.py"):
        TokenShards(tmp_path / "empty", "train")

    data = make_data_dir(tmp_path / "d", {"train": np.arange(25), "val": np.arange(7)}, 10)
    with (data / "train_00001.bin").open("r+b") as f:
        f.truncate(7)
    with pytest.raises(DataError, match=r"train_00001.bin: 7 bytes.*10 tokens x 2 bytes"):
        TokenShards(data, "train")
    (data / "val_00000.bin").unlink()
    with pytest.raises(DataError, match=r"val_00000.bin: shard listed in meta.json is missing"):
        TokenShards(data, "val")

    meta = json.loads((data / META_FILE).read_text())
    (data / META_FILE).write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(DataError, match=r"meta.json: unknown dtype 'float32'"):
        TokenShards(data, "train")


def test_check_vocab_names_model_vocab_size():
    check_vocab(8192, 8192)
    check_vocab(512, 8192)
    with pytest.raises(DataError, match=r"model.vocab_size=1024.*8192"):
        check_vocab(8192, 1024)


def take(sampler: ResumableSampler, steps: int) -> List[List[int]]:
    return [sampler.next_global_batch().tolist() for _ in range(steps)]


@pytest.mark.parametrize("order", ["bijection-v1", "permutation-v1"])
def test_sampler_is_deterministic_and_resumes_exactly(order):
    full = take(ResumableSampler(50, 8, 0, 1, seed=3, order=order), 20)
    assert full == take(ResumableSampler(50, 8, 0, 1, seed=3, order=order), 20)
    assert full != take(ResumableSampler(50, 8, 0, 1, seed=4, order=order), 20)

    first = ResumableSampler(50, 8, 0, 1, seed=3, order=order)
    head = take(first, 7)
    state = first.state_dict()
    assert state == {"consumed_samples": 56, "order": order}
    resumed = ResumableSampler(50, 8, 0, 1, seed=3)  # a new run's order: the state's wins
    resumed.load_state_dict(state)
    assert head + take(resumed, 13) == full
    assert take(ResumableSampler(50, 8, 0, 1, seed=3, consumed_samples=56, order=order),
                13) == full[7:]


def test_sampler_dp_slices_concatenate_to_the_serial_batch():
    serial = take(ResumableSampler(30, 12, 0, 1, seed=0), 6)
    ranks = [take(ResumableSampler(30, 12, d, 3, seed=0), 6) for d in range(3)]
    for step in range(6):
        assert sum((ranks[d][step] for d in range(3)), []) == serial[step]
        assert all(len(ranks[d][step]) == 4 for d in range(3))


def test_sampler_epochs_wrap_into_fresh_permutations():
    """The order of runs from before "bijection-v1" (tests/unit/data/test_sample_order.py: the new one)."""
    batches = take(ResumableSampler(10, 4, 0, 1, seed=7, order="permutation-v1"), 5)  # 2 epochs
    order = sum(batches, [])
    assert order[:10] == np.random.default_rng(7).permutation(10).tolist()
    assert order[10:] == np.random.default_rng(8).permutation(10).tolist()
    assert sorted(order) == sorted(list(range(10)) * 2)


def test_data_is_checked_before_launch(tmp_path):
    """Enough training windows for one global batch; a validation window only when the run
    evaluates (train.eval_every > 0); the vocabulary fits."""
    data = make_data_dir(tmp_path / "d", {"train": np.arange(50), "val": np.arange(5)}, 100)
    check_data([data], 4, 12, 8192, evaluates=False)  # 12 windows of 4 + 1 tokens
    with pytest.raises(DataError, match=r"train.global_batch_size=16.*only 12 samples"):
        check_data([data], 4, 16, 8192, evaluates=False)
    check_data([data], 4, 12, 8192, evaluates=True)  # one validation window
    with pytest.raises(DataError, match=r"train.seq_len=8: the validation split.*eval_every=0"):
        check_data([data], 8, 6, 8192, evaluates=True)
    check_data([data], 8, 6, 8192, evaluates=False)
    with pytest.raises(DataError, match="model.vocab_size=64"):
        check_data([data], 4, 12, 64, evaluates=False)


def test_sampler_refuses_too_little_data():
    with pytest.raises(DataError,
                       match=r"train.global_batch_size=32.*only 10 samples.*train.seq_len"):
        ResumableSampler(10, 32, 0, 1, seed=0)
    with pytest.raises(DataError, match="train.global_batch_size=10"):
        ResumableSampler(100, 10, 0, 4, seed=0)


def test_train_batches_follow_the_rank_slice(stdlib_data):
    shards = TokenShards(stdlib_data, "train")
    seq, mb = 16, 2
    n = shards.num_samples(seq)
    sampler = ResumableSampler(n, 8, dp_rank=1, dp_size=2, seed=5)
    indices = ResumableSampler(n, 8, dp_rank=1, dp_size=2, seed=5).next_global_batch()
    step = TrainBatches([shards], sampler, mb, seq, torch.device("cpu")).next_step()
    assert len(step) == 2 and sampler.consumed_samples == 8
    for j, (x, y) in enumerate(step):
        assert x.shape == y.shape == (mb, seq) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for r in range(mb):
            window = torch.from_numpy(shards.sample(int(indices[j * mb + r]), seq))
            assert torch.equal(x[r], window[:-1]) and torch.equal(y[r], window[1:])


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_read_the_same_windows_and_keep_their_chunks(stdlib_data, cp):
    """Every CP rank of a DP rank reads the same windows; rank r keeps chunks r and
    2cp-1-r of the inputs and the targets (`context_shard`), which reassemble the window."""
    shards = TokenShards(stdlib_data, "train")
    seq, n = 16, shards.num_samples(16)
    cpu = torch.device("cpu")

    def step(cp_rank):
        sampler = ResumableSampler(n, 4, dp_rank=0, dp_size=1, seed=5)
        return TrainBatches([shards], sampler, 2, seq, cpu, cp=(cp, cp_rank)).next_step()

    serial = TrainBatches([shards], ResumableSampler(n, 4, 0, 1, seed=5), 2, seq,
                          cpu).next_step()
    ranks = [step(r) for r in range(cp)]
    chunk = seq // (2 * cp)
    for j, (x, y) in enumerate(serial):
        for r in range(cp):
            mine = [x[:, i * chunk:(i + 1) * chunk] for i in (r, 2 * cp - 1 - r)]
            theirs = [y[:, i * chunk:(i + 1) * chunk] for i in (r, 2 * cp - 1 - r)]
            assert torch.equal(ranks[r][j][0], torch.cat(mine, dim=1))
            assert torch.equal(ranks[r][j][1], torch.cat(theirs, dim=1))
    val = [val_batches([shards], 2, seq, 1, 4, dp_rank=0, dp_size=1, device=cpu, cp=(cp, r))
           for r in range(cp)]
    full = val_batches([shards], 2, seq, 1, 4, dp_rank=0, dp_size=1, device=cpu)
    assert all(torch.equal(v[0][0], torch.cat([full[0][0][:, i * chunk:(i + 1) * chunk]
                                               for i in (r, 2 * cp - 1 - r)], dim=1))
               for r, v in enumerate(val))


def test_val_batches_are_fixed_shared_over_dp_and_wrap(tmp_path):
    data = make_data_dir(tmp_path / "d", {"train": np.arange(50), "val": np.arange(13)}, 100)
    shards = TokenShards(data, "val")
    cpu = torch.device("cpu")
    assert shards.num_samples(4) == 3
    # 3 global batches of 2 windows, micro-batch 2, one rank
    serial = val_batches([shards], 2, 4, 3, 2, dp_rank=0, dp_size=1, device=cpu)
    again = val_batches([shards], 2, 4, 3, 2, dp_rank=0, dp_size=1, device=cpu)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(serial, again))
    starts = [int(x[r, 0]) for x, _ in serial for r in range(2)]
    assert starts == [0, 4, 8, 0, 4, 8]  # 3 windows, wrapped
    # two DP ranks, micro-batch 1: each global batch is split between them, same windows
    ranks = [val_batches([shards], 1, 4, 3, 2, dp_rank=d, dp_size=2, device=cpu)
             for d in range(2)]
    assert [int(ranks[d][k][0][0, 0]) for k in range(3) for d in range(2)] == starts
    with pytest.raises(DataError, match="train.seq_len=20"):
        val_batches([shards], 1, 20, 1, 1, dp_rank=0, dp_size=1, device=cpu)


def test_sampler_state_names_its_order():
    """A data position says which sample order it counts in; one without the key (written
    before orders were named) is the first order, an unknown order is refused by name."""
    sampler = ResumableSampler(50, 8, 0, 1, seed=3)
    sampler.load_state_dict({"consumed_samples": 16})
    assert sampler.state_dict() == {"consumed_samples": 16, "order": "permutation-v1"}
    with pytest.raises(DataError, match="sample order 'bijection-v9'"):
        sampler.load_state_dict({"consumed_samples": 16, "order": "bijection-v9"})


def test_the_open_file_limit_is_logged_once_a_process(monkeypatch, caplog):
    """The first build raises the limit and says so; later builds of the process (the
    self-test's layouts: it said it 11 times) find it raised and say nothing at info level."""
    import logging

    from megalite.train import build

    limits = iter([(1024, 4096), (4096, 4096), (4096, 4096)])
    monkeypatch.setattr(build, "raise_open_file_limit", lambda: next(limits))
    with caplog.at_level(logging.INFO, logger="megalite"):
        for _ in range(3):
            build.shard_files()
    said = [r.getMessage() for r in caplog.records if "open-file limit" in r.getMessage()]
    assert len(said) == 1 and "raised from 1024 to 4096" in said[0]
