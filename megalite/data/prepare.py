"""Preparing token shards: documents -> tokenizer -> EOS-separated, packed memmap shards.

    source documents (megalite.data.sources: downloaded or streamed, in a fixed order)
      --batches of DOCS_PER_BATCH, tokenized in num_proc processes (megalite.data.tokenize)-->
      per document: ids + [EOS], to the split its index hashes to
      --ShardWriter (megalite.data.writer: temp file, fsync, rename; progress.json)-->
      <split>_00000.bin ... (uint16 / uint32) + meta.json

Tokenizer: any HF fast tokenizer (a hub id such as `gpt2`, or a local directory), or `train` =
a byte-level BPE of `tokenizer_vocab_size` tokens trained on the training documents among the
first `tokenizer_train_documents` documents (all of them when that is null; a stream needs it).

Everything is built in a sibling `<dir>.tmp` directory and renamed into place only when
meta.json is written, so an interrupted preparation never looks complete; run again with the
same settings, it resumes from its last complete shard (see megalite.data.writer).

Data format 2 (meta.json `format_version`): the split is a function of each document's index
(`split.method` = "hash-v1"). Format 1 directories (a seeded permutation of the document count)
read the same way: the loader only reads the shard lists.
"""
from __future__ import annotations

import logging
import shutil
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megalite.config.schema import DataConfig
from megalite.data.errors import DataError
from megalite.data.loader import META_FILE, SPLITS, token_dtype
from megalite.data.sources import DocumentSource, stdlib_files
from megalite.data.tokenize import SPLIT_SEED, BatchTokenizer, is_validation, tokenized_batches
from megalite.data.writer import MANIFEST, ShardWriter, read_manifest, write_json

EOS_TOKEN = "<|endoftext|>"  # GPT-2's document separator
FORMAT_VERSION = 2
SPLIT_METHOD = "hash-v1"
TOKENIZER_DIR = "tokenizer"
MIN_TRAINED_VOCAB = 256 + 2  # byte alphabet + EOS + at least one merge
DOCS_PER_BATCH = 256
LOG_EVERY_S = 30.0
# The settings a resumed preparation must share with the interrupted one (not streaming or
# num_proc: they do not change the shards).
RESUME_KEYS = ("source", "config_name", "revision", "split", "data_files", "text_field",
               "tokenizer", "tokenizer_vocab_size", "tokenizer_train_documents", "val_fraction",
               "shard_tokens", "max_documents")
log = logging.getLogger("megalite")

__all__ = ["EOS_TOKEN", "FORMAT_VERSION", "ShardWriter", "prepare", "split_documents",
           "stdlib_files"]


def split_documents(num_documents: int, val_fraction: float) -> dict:
    """Document indices of each split among the first `num_documents` (format 2's rule)."""
    val = is_validation(np.arange(num_documents), val_fraction)
    return {"train": np.flatnonzero(~val), "val": np.flatnonzero(val)}


def check_settings(cfg: DataConfig) -> None:
    """The data section's preparation keys, before any work."""
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
    if cfg.tokenizer_train_documents is not None and cfg.tokenizer_train_documents < 1:
        raise DataError(f"data.tokenizer_train_documents={cfg.tokenizer_train_documents}: must "
                        "be >= 1 (e.g. 100000), or null for every training document")
    if cfg.streaming and cfg.tokenizer == "train" and cfg.tokenizer_train_documents is None:
        raise DataError("data.tokenizer=train with data.streaming=true: a stream cannot be read "
                        "twice whole, so say how many of its first documents train the "
                        "tokenizer, e.g. data.tokenizer_train_documents=100000; or give a "
                        "tokenizer (data.tokenizer=gpt2 or a directory), or data.streaming=false")
    if cfg.streaming and cfg.source == "stdlib":
        raise DataError("data.streaming=true: data.source=stdlib reads local files, there is "
                        "nothing to stream; set data.streaming=false")


def train_tokenizer(texts: Iterator[str], vocab_size: int):
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


def load_tokenizer(name: str, key: str = "data.tokenizer"):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise DataError(f"{key}={name!r}: cannot load it ({e}); give an HF tokenizer "
                        "directory, a hub id such as gpt2 (needs the hub or its cache), or "
                        "`train` to train a byte-level BPE on the corpus") from e
    if tok.eos_token_id is None:
        raise DataError(f"{key}={name!r}: has no EOS token to separate documents")
    if not getattr(tok, "is_fast", False):
        raise DataError(f"{key}={name!r}: only a slow (Python) tokenizer exists; the "
                        "preparation needs a fast one (a tokenizer.json)")
    return tok


def _training_texts(source: DocumentSource, cfg: DataConfig) -> Iterator[str]:
    """The non-empty training documents among the first tokenizer_train_documents."""
    limit = cfg.tokenizer_train_documents
    for start, texts in source.batches(0, DOCS_PER_BATCH):
        if limit is not None and start >= limit:
            return
        texts = texts[:None if limit is None else limit - start]
        val = is_validation(np.arange(start, start + len(texts)), cfg.val_fraction)
        yield from (t for t, v in zip(texts, val) if t and not v)


def _settings(cfg: DataConfig) -> dict:
    values = {k: getattr(cfg, k) for k in RESUME_KEYS}
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else list(v)
            for k, v in values.items()}


def _resume_state(cfg: DataConfig, tmp: Path) -> Optional[dict]:
    """The manifest of an interrupted preparation with these settings (None: start over)."""
    manifest = read_manifest(tmp) if tmp.is_dir() else None
    if manifest is None:
        if tmp.exists():
            shutil.rmtree(tmp)  # interrupted before its first manifest: nothing to keep
        return None
    for key, value in _settings(cfg).items():
        if manifest["settings"].get(key) != value:
            raise DataError(f"data.{key}={value!r}: {tmp} holds an interrupted preparation "
                            f"made with data.{key}={manifest['settings'].get(key)!r}; rerun with "
                            f"its settings to resume it, or delete {tmp} to start over")
    return manifest


def prepare(cfg: DataConfig, out_dir: Path, progress: bool = True) -> dict:
    """Build a complete data directory at `out_dir` (resuming an interrupted one);
    returns its meta.json contents."""
    out_dir = Path(out_dir)
    check_settings(cfg)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(f"data.dir={str(out_dir)!r}: exists and is not a complete preparation "
                        "(no valid meta.json); delete it or pick another data.dir")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    manifest = _resume_state(cfg, tmp)
    tokenizer = None
    if manifest is None and cfg.tokenizer != "train":
        tokenizer = load_tokenizer(cfg.tokenizer)
    source = DocumentSource(cfg)
    if manifest is None:
        tmp.mkdir(parents=True)
        if tokenizer is None:
            tokenizer = train_tokenizer(_training_texts(source, cfg), cfg.tokenizer_vocab_size)
        tokenizer.model_max_length = int(1e30)  # documents are packed, never truncated
        tokenizer.save_pretrained(tmp / TOKENIZER_DIR)
    else:
        tokenizer = load_tokenizer(str(tmp / TOKENIZER_DIR), key=f"{tmp}/{TOKENIZER_DIR}")
        log.info("resuming the preparation in %s from document %d (%s)", tmp,
                 manifest["documents_read"], ", ".join(
                     f"{s}: {len(manifest['splits'][s]['shards'])} complete shard(s)"
                     for s in SPLITS))
    meta = _tokenize_all(cfg, source, tokenizer, tmp, manifest, progress)
    _publish(tmp, out_dir, meta)
    return meta


def _tokenizer_name(cfg: DataConfig) -> str:
    return "trained byte-level BPE" if cfg.tokenizer == "train" else cfg.tokenizer


def _tokenize_all(cfg: DataConfig, source: DocumentSource, tokenizer, tmp: Path,
                  manifest: Optional[dict], progress: bool) -> dict:
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    dtype = token_dtype(vocab_size)
    tokenizer_crc = zlib.crc32(tokenizer.backend_tokenizer.to_str().encode())
    if manifest is not None and manifest.get("tokenizer_crc32", tokenizer_crc) != tokenizer_crc:
        raise DataError(f"{tmp / TOKENIZER_DIR}: differs from the tokenizer the interrupted "
                        f"preparation in {tmp} started with (its CRC32 in {tmp / MANIFEST}); "
                        f"delete {tmp} to start over")
    state = manifest or {"settings": _settings(cfg), "documents_read": 0,
                         "tokenizer_crc32": tokenizer_crc,
                         "splits": {s: {"shards": [], "partial": None, "documents": 0,
                                        "tokens": 0} for s in SPLITS}}
    writers = {s: ShardWriter.resume(tmp, s, dtype, cfg.shard_tokens, state["splits"][s])
               for s in SPLITS}
    counts = {s: {k: state["splits"][s][k] for k in ("documents", "tokens")} for s in SPLITS}
    read = state["documents_read"]

    def commit() -> None:
        for w in writers.values():
            w.sync()
        splits = {s: {**writers[s].state(), **counts[s]} for s in SPLITS}
        write_json(tmp / MANIFEST, {**state, "documents_read": read, "splits": splits})

    if manifest is None:
        commit()  # the tokenizer is saved: from here on the preparation resumes
    tokenize = BatchTokenizer(tokenizer.backend_tokenizer.to_str(), eos, dtype.name,
                              cfg.val_fraction)
    meter = TokenMeter(progress, total_documents=source.known_length(), done_documents=read)
    for size, result in tokenized_batches(source.batches(read, DOCS_PER_BATCH), tokenize,
                                          cfg.num_proc):
        for split, (ids, docs) in result.items():
            writers[split].write(ids)
            counts[split]["documents"] += docs
            counts[split]["tokens"] += int(ids.size)
        read += size
        meter.update(size, sum(int(ids.size) for ids, _ in result.values()))
        if any(w.shards_completed for w in writers.values()):
            commit()
    meter.close()
    if counts["val"]["documents"] == 0 and cfg.val_fraction > 0:
        log.warning("no document of the %d read fell in the validation split "
                    "(data.val_fraction=%s); raise data.val_fraction, or train with "
                    "train.eval_every=0", read, cfg.val_fraction)
    if counts["train"]["documents"] == 0:
        raise DataError(f"data.source={cfg.source!r}: no non-empty training document among the "
                        f"{read} read; check data.text_field and data.max_documents")
    return {"format_version": FORMAT_VERSION, "vocab_size": vocab_size, "eos_token_id": eos,
            "dtype": dtype.name, "tokenizer": {"name": _tokenizer_name(cfg), "dir": TOKENIZER_DIR},
            "source": {k: state["settings"][k] for k in
                       ("source", "config_name", "revision", "split", "data_files",
                        "text_field", "max_documents")},
            "split": {"method": SPLIT_METHOD, "seed": SPLIT_SEED,
                      "val_fraction": cfg.val_fraction, "documents_read": read},
            "splits": {s: {"shards": writers[s].close(), **counts[s]} for s in SPLITS}}


def _publish(tmp: Path, out_dir: Path, meta: dict) -> None:
    """meta.json written (fsynced), the directory renamed into place, then the manifest
    dropped: a crash between the two leaves a complete directory with a stale manifest (which
    nothing reads), never a finished preparation that the next run would start over."""
    write_json(tmp / META_FILE, meta)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked before)
    tmp.replace(out_dir)
    (out_dir / MANIFEST).unlink()


class TokenMeter:
    """Progress in tokens and tokens/s: a tqdm bar when tqdm is installed and `progress`, else
    a log line every LOG_EVERY_S seconds."""

    def __init__(self, progress: bool, total_documents: Optional[int], done_documents: int):
        self.start, self.last_log = time.perf_counter(), time.perf_counter()
        self.tokens, self.documents, self.total = 0, done_documents, total_documents
        self.bar = None
        if progress:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(desc="tokenize", unit="tok", unit_scale=True)
            except ImportError:
                pass
        self.progress = progress

    def update(self, documents: int, tokens: int) -> None:
        self.tokens += tokens
        self.documents += documents
        of = f"/{self.total:,}" if self.total else ""
        if self.bar is not None:
            self.bar.update(tokens)
            self.bar.set_postfix_str(f"{self.documents:,}{of} documents", refresh=False)
        elif self.progress and time.perf_counter() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.perf_counter()
            log.info("prepare: %s documents%s, %s tokens, %.0f tokens/s", f"{self.documents:,}",
                     of, f"{self.tokens:,}", self.tokens / (self.last_log - self.start))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

