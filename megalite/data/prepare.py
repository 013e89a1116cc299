"""Preparing token shards: HF dataset -> tokenizer -> EOS-separated, packed memmap shards.

    documents --(drop empty, cap at max_documents)--> train/val split (by document)
              --tokenize (datasets.map, num_proc processes)--> ids + [EOS] per document
              --ShardWriter--> <split>_00000.bin ... (uint16 / uint32) + meta.json

Sources: `stdlib` (this Python's own standard-library .py files: present on every machine, so the
default needs no network), or anything `datasets.load_dataset` reads — a hub dataset with a
config and split on a cluster, or local `text` / `json` / `parquet` / `csv` files via
`data.data_files`. Tokenizer: any HF tokenizer (a hub id such as `gpt2`, or a local directory),
or `train` = a byte-level BPE of `tokenizer_vocab_size` tokens trained on the training split
with HF `tokenizers` and saved as an HF tokenizer directory.

Everything is built in a sibling `<dir>.tmp` directory and renamed into place only when
meta.json is written, so an interrupted preparation never looks complete.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

from megalite.config import DataConfig
from megalite.data.loader import META_FILE, SPLITS, DataError, token_dtype

EOS_TOKEN = "<|endoftext|>"  # GPT-2's document separator
FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"
LOCAL_BUILDERS = ("text", "json", "parquet", "csv")
MIN_TRAINED_VOCAB = 256 + 2  # byte alphabet + EOS + at least one merge


def stdlib_files() -> List[Path]:
    """Non-empty .py files of this interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
             and p.is_file() and p.stat().st_size > 0]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_documents(num_documents: int, val_fraction: float) -> Dict[str, np.ndarray]:
    """Document indices of each split: a fixed-seed draw of round(n * val_fraction) documents
    (at least one, while one is left for training) for validation, in corpus order."""
    n_val = min(max(1, round(num_documents * val_fraction)), max(0, num_documents - 1))
    val = np.sort(np.random.default_rng(0).permutation(num_documents)[:n_val])
    train = np.setdiff1d(np.arange(num_documents), val)
    return {"train": train, "val": val}


class ShardWriter:
    """Appends token ids to `<split>_00000.bin, ...`, at most `shard_tokens` per file."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype = Path(out_dir), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.entries: List[dict] = []
        self._file = None

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.split}_{len(self.entries):05d}.bin"
        self._file = open(self.out_dir / name, "wb")
        self.entries.append({"file": name, "tokens": 0})

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise DataError(f"token id out of range for {self.dtype.name} shards")
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None or self.entries[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.entries[-1]["tokens"]
            chunk, tokens = tokens[:room], tokens[room:]
            self._file.write(chunk.tobytes())
            self.entries[-1]["tokens"] += int(chunk.size)

    def close(self) -> List[dict]:
        self._close_current()
        return self.entries


def _check_settings(cfg: DataConfig) -> None:
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction={cfg.val_fraction}: must be in [0, 1), e.g. 0.005")
    if cfg.tokenizer == "train" and cfg.tokenizer_vocab_size < MIN_TRAINED_VOCAB:
        raise DataError(f"data.tokenizer_vocab_size={cfg.tokenizer_vocab_size}: a byte-level BPE "
                        f"needs at least {MIN_TRAINED_VOCAB} tokens (256 bytes + EOS + merges); "
                        "e.g. 8192")
    if cfg.num_proc < 1 or cfg.shard_tokens < 1:
        raise DataError(f"data.num_proc={cfg.num_proc}, data.shard_tokens={cfg.shard_tokens}: "
                        "both must be >= 1")
    if cfg.max_documents is not None and cfg.max_documents < 2:
        raise DataError(f"data.max_documents={cfg.max_documents}: need at least 2 documents "
                        "(one for each split), or null for all")
    if cfg.source in LOCAL_BUILDERS:
        if not cfg.data_files:
            raise DataError(f"data.data_files={cfg.data_files!r}: data.source={cfg.source!r} "
                            "reads local files; list them, e.g. data.data_files=[/data/a.jsonl]")
        for pattern in cfg.data_files:
            if not glob.glob(os.path.expanduser(pattern)):
                raise DataError(f"data.data_files: {pattern!r} matches no file")


def _load_documents(cfg: DataConfig):
    """The corpus as a `datasets.Dataset` with one string column `text`."""
    import datasets

    if cfg.source == "stdlib":
        files = stdlib_files()[:cfg.max_documents]
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        return datasets.Dataset.from_dict({"text": texts})
    kwargs = {"data_files": [os.path.expanduser(f) for f in cfg.data_files]} \
        if cfg.data_files else {}
    try:
        ds = datasets.load_dataset(cfg.source, cfg.config_name, split=cfg.split, **kwargs)
    except Exception as e:
        raise DataError(f"data.source={cfg.source!r} (config {cfg.config_name!r}, split "
                        f"{cfg.split!r}): datasets.load_dataset failed: {e}") from e
    if cfg.text_field not in ds.column_names:
        raise DataError(f"data.text_field={cfg.text_field!r}: the dataset has columns "
                        f"{ds.column_names}; set data.text_field to the one holding the text")
    ds = ds.select_columns([cfg.text_field])
    if cfg.text_field != "text":
        ds = ds.rename_column(cfg.text_field, "text")
    ds = ds.filter(lambda batch: [bool(t) for t in batch["text"]], batched=True,
                   num_proc=cfg.num_proc if len(ds) > 10_000 else None,
                   desc="drop empty documents")
    if cfg.max_documents is not None:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    return ds


def _train_tokenizer(texts: Iterator[str], vocab_size: int):
    """A GPT-2-style byte-level BPE trained on `texts`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN,
                                   bos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
                                   clean_up_tokenization_spaces=False)


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise DataError(f"data.tokenizer={name!r}: cannot load it ({e}); give an HF tokenizer "
                        "directory, a hub id such as gpt2 (needs the hub or its cache), or "
                        "`train` to train a byte-level BPE on the corpus") from e
    if tok.eos_token_id is None:
        raise DataError(f"data.tokenizer={name!r}: has no EOS token to separate documents")
    return tok


def _tokenize(batch: Dict[str, list], tokenizer, eos: int) -> Dict[str, list]:
    ids = tokenizer(batch["text"], add_special_tokens=False, split_special_tokens=True
                    )["input_ids"]
    return {"ids": [x + [eos] for x in ids]}


def _write_split(ds, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 progress: bool) -> dict:
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    writer = ShardWriter(out_dir, split, dtype, shard_tokens)
    total = 0
    with tqdm(total=len(ds), desc=f"write {split}", unit="doc", disable=not progress) as bar:
        for batch in ds.with_format("arrow").iter(batch_size=10_000):
            # the documents' token lists, concatenated by Arrow (no Python loop per token)
            stream = pc.list_flatten(batch.column("ids")).to_numpy().astype(np.int64, copy=False)
            writer.write(stream)
            total += stream.size
            bar.update(batch.num_rows)
    return {"shards": writer.close(), "tokens": total, "documents": len(ds)}


def prepare(cfg: DataConfig, out_dir: Path, progress: bool = True) -> dict:
    """Build a complete data directory at `out_dir`; returns its meta.json contents."""
    import datasets

    out_dir = Path(out_dir)
    _check_settings(cfg)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(f"data.dir={str(out_dir)!r}: exists and is not a complete preparation "
                        "(no valid meta.json); delete it or pick another data.dir")
    tokenizer = None if cfg.tokenizer == "train" else _load_tokenizer(cfg.tokenizer)
    if not progress:
        datasets.disable_progress_bars()
    docs = _load_documents(cfg)
    if len(docs) < 2:
        raise DataError(f"data.source={cfg.source!r}: found {len(docs)} non-empty document(s); "
                        "need at least 2 (one per split)")
    split_idx = split_documents(len(docs), cfg.val_fraction)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if tokenizer is None:
        train_docs = docs.select(split_idx["train"])
        tokenizer = _train_tokenizer(
            (t for b in train_docs.iter(batch_size=1000) for t in b["text"]),
            cfg.tokenizer_vocab_size)
        tokenizer_name = "trained byte-level BPE"
    else:
        tokenizer_name = cfg.tokenizer
    tokenizer.model_max_length = int(1e30)  # documents are packed, never truncated
    tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    dtype = token_dtype(vocab_size)
    tokenized = docs.map(_tokenize, batched=True, remove_columns=["text"],
                         fn_kwargs={"tokenizer": tokenizer, "eos": eos},
                         num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                         desc="tokenize")
    splits = {split: _write_split(tokenized.select(split_idx[split]), tmp, split, dtype,
                                  cfg.shard_tokens, progress) for split in SPLITS}
    meta = {"format_version": FORMAT_VERSION, "vocab_size": vocab_size, "eos_token_id": eos,
            "dtype": dtype.name, "tokenizer": {"name": tokenizer_name, "dir": TOKENIZER_DIR},
            "source": {"source": cfg.source, "config_name": cfg.config_name, "split": cfg.split,
                       "data_files": list(cfg.data_files) if cfg.data_files else None,
                       "text_field": cfg.text_field, "max_documents": cfg.max_documents},
            "splits": splits}
    with open(tmp / META_FILE, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above)
    os.replace(tmp, out_dir)
    return meta
