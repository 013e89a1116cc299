"""Reading token shards for training: memmapped shards, batches, the checks before launch.

A data directory (written by `scripts/prepare_data.py`) holds `meta.json` and, per split, flat
binary shards `<split>_00000.bin, ...` of uint16 (vocab <= 65536) or uint32 token ids, documents
separated by EOS. Shards are not opened up front: windows are read with `pread` through a bounded
set of open descriptors (`megalite.data.files`), so the number of shards is not limited by the
open-file limit. A *sample* is a window of seq_len + 1 consecutive tokens inside one shard
(windows start every seq_len tokens, so input x = w[:-1] and target y = w[1:] cover the stream
once); windows never cross a shard boundary. With context parallelism every CP rank of a
(tp, pp, dp) reads the same windows and keeps its two chunks of each (`cp`: (size, rank);
`megalite.parallel.context_shard`), of the inputs and the targets alike.

Sample order, DP slicing and blends: `megalite.data.sampler`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megalite.data.documents import DocumentRule
from megalite.data.errors import DataError, too_few_train_samples
from megalite.data.files import ShardFiles
from megalite.data.sampler import blend_choices
from megalite.parallel import context_shard

META_FILE = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
PREPARE_HINT = "run `megalite-prepare data.dir=<dir>` (scripts/prepare_data.py) first"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """Every token id of the data must have a row in the model's embedding."""
    if tokenizer_vocab > model_vocab:
        raise DataError(f"model.vocab_size={model_vocab}: the data's tokenizer has "
                        f"{tokenizer_vocab} tokens; set model.vocab_size>={tokenizer_vocab} "
                        "or prepare the data with a smaller tokenizer")


def read_meta(data_dir: Path, hint: str = PREPARE_HINT) -> dict:
    """The prepared directory's meta.json; DataError ending with `hint` (how to prepare it)
    where the directory or its meta.json is missing or unreadable."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data.dir={str(data_dir)!r}: no such directory; {hint}")
    path = data_dir / META_FILE
    if not path.is_file():
        raise DataError(f"data.dir={str(data_dir)!r}: no {META_FILE} (not prepared, or "
                        f"preparation did not finish); {hint}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e}); {hint}") from e
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"{path}: unknown dtype {meta.get('dtype')!r} (expected one of "
                        f"{sorted(DTYPES)}); {hint}")
    return meta


class TokenShards:
    """One split of a data directory, checked against meta.json (each shard's size) without
    opening a shard; windows are read on demand through `files` (bounded open descriptors,
    shared by the process's TokenShards; a private one by default)."""

    def __init__(self, data_dir: Path, split: str, files: Optional[ShardFiles] = None):
        self.dir = Path(data_dir)
        self.meta = read_meta(self.dir)
        self.dtype = np.dtype(DTYPES[self.meta["dtype"]])
        if split not in self.meta.get("splits", {}):
            raise DataError(f"{self.dir / META_FILE}: no split {split!r}; {PREPARE_HINT}")
        self.paths: List[Path] = []
        tokens = []
        for entry in self.meta["splits"][split]["shards"]:
            path = self.dir / entry["file"]
            if not path.is_file():
                raise DataError(f"{path}: shard listed in {META_FILE} is missing; {PREPARE_HINT}")
            expected = entry["tokens"] * self.dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise DataError(f"{path}: {actual} bytes, but {META_FILE} lists {entry['tokens']} "
                                f"tokens x {self.dtype.itemsize} bytes = {expected} (truncated "
                                f"or from another preparation); {PREPARE_HINT}")
            self.paths.append(path)
            tokens.append(entry["tokens"])
        self.shard_tokens = np.array(tokens, dtype=np.int64)
        self._names = [str(p) for p in self.paths]  # the descriptor cache's keys (cheap hash)
        self.files = files if files is not None else ShardFiles()
        self._ends: Dict[int, np.ndarray] = {}

    def _window_ends(self, seq_len: int) -> np.ndarray:
        """Per shard, the cumulative number of windows up to and including it."""
        if seq_len not in self._ends:
            self._ends[seq_len] = np.cumsum(np.maximum(0, (self.shard_tokens - 1) // seq_len))
        return self._ends[seq_len]

    def num_samples(self, seq_len: int) -> int:
        ends = self._window_ends(seq_len)
        return int(ends[-1]) if len(ends) else 0

    def samples(self, indices: Sequence[int], seq_len: int) -> np.ndarray:
        """Windows `indices` (seq_len + 1 tokens each), as a (len(indices), seq_len + 1) int64
        array; read shard by shard in file order."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        total = self.num_samples(seq_len)
        if indices.size and not (0 <= indices.min() and indices.max() < total):
            bad = indices[(indices < 0) | (indices >= total)][0]
            raise IndexError(f"sample {bad} out of range [0, {total})")
        ends = self._window_ends(seq_len)
        shards = np.searchsorted(ends, indices, side="right")
        starts = (indices - (ends[shards] - np.diff(ends, prepend=0)[shards])) * seq_len
        raw = np.empty((len(indices), seq_len + 1), dtype=self.dtype)
        shards, offsets = shards.tolist(), (starts * self.dtype.itemsize).tolist()
        for row in np.argsort(indices, kind="stable").tolist():
            self.files.read_into(self._names[shards[row]], offsets[row], raw[row])
        return raw.astype(np.int64)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Window `index` (seq_len + 1 tokens) as int64."""
        return self.samples([index], seq_len)[0]


def _to_batch(windows: np.ndarray, device: torch.device, reads: Tuple[bool, bool],
              documents: Optional[DocumentRule] = None, cp: Tuple[int, int] = (1, 0)
              ) -> tuple:
    """(inputs, targets) of a (k, seq_len + 1) array of windows; None for a part not read.
    With a `documents` rule, (inputs, targets, Documents): every pipeline stage gets the
    documents (each stage's attention needs them), derived from the tokens it read.
    `cp` = (size, rank): each of them this CP rank's two chunks of the sequence (the
    documents found over the whole windows, then sharded alike)."""
    w = torch.from_numpy(windows)
    docs = documents.of(windows[:, :-1], cp) if documents is not None else None
    if device.type == "cuda":
        w = w.pin_memory().to(device, non_blocking=True)
    size, rank = cp
    inputs = context_shard.shard(w[:, :-1], size, rank, dim=1) if reads[0] else None
    targets = context_shard.shard(w[:, 1:], size, rank, dim=1) if reads[1] else None
    return (inputs, targets) if docs is None else (inputs, targets, docs.to(device))


class TrainBatches:
    """Micro-batches (x, y) of one optimizer step for this DP rank, from the sampler's
    (dataset, window) pairs over `sources` (one TokenShards per blended dataset).

    `reads` = (inputs, targets): what this rank's model stage consumes — the first pipeline
    stage the inputs, the last the targets, a middle stage neither. What is not consumed is
    None and, where neither is, no token is read; the sampler advances on every rank alike.
    With a `documents` rule (`megalite.data.documents`) every rank reads the windows and each
    micro-batch is (x, y, Documents). `cp` = (size, rank): the batches hold this CP rank's
    chunks of every window."""

    def __init__(self, sources: Sequence[TokenShards], sampler, micro_batch_size: int,
                 seq_len: int, device: torch.device, reads: Tuple[bool, bool] = (True, True),
                 documents: Optional[DocumentRule] = None, cp: Tuple[int, int] = (1, 0)):
        self.sources, self.sampler = list(sources), sampler
        self.micro_batch_size, self.seq_len, self.device = micro_batch_size, seq_len, device
        self.reads, self.documents, self.cp = tuple(reads), documents, tuple(cp)
        self.last_samples: List[Tuple[int, int]] = []  # the last step's (dataset, window)s

    def close(self) -> None:
        """Close the shard descriptors (a later read opens them again)."""
        for shards in self.sources:
            shards.files.close()

    def next_step(self, global_batch_size: Optional[int] = None
                  ) -> List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """This rank's micro-batches of the next global batch (of the sampler's size unless
        given: a batch-size ramp)."""
        datasets, windows = self.sampler.next_windows(global_batch_size)
        self.last_samples = list(zip(datasets.tolist(), windows.tolist()))
        mb = self.micro_batch_size
        if not any(self.reads) and self.documents is None:
            return [(None, None)] * (len(windows) // mb)
        tokens = read_windows(self.sources, datasets, windows, self.seq_len)
        return [_to_batch(tokens[j:j + mb], self.device, self.reads, self.documents, self.cp)
                for j in range(0, len(windows), mb)]


def read_windows(sources: Sequence[TokenShards], datasets: np.ndarray, windows: np.ndarray,
                 seq_len: int) -> np.ndarray:
    """The (len(windows), seq_len + 1) int64 tokens of window windows[i] of dataset
    datasets[i]."""
    if len(sources) == 1:
        return sources[0].samples(windows, seq_len)
    out = np.empty((len(windows), seq_len + 1), dtype=np.int64)
    for d, source in enumerate(sources):
        sel = datasets == d
        if sel.any():
            out[sel] = source.samples(windows[sel], seq_len)
    return out


def check_data(data_dirs: Sequence[Path], seq_len: int, global_batch_size: int,
               model_vocab: int, evaluates: bool, hint: str = PREPARE_HINT) -> None:
    """Before launch, for every dataset of the run: both splits are readable, every token id
    fits the model's vocabulary, and (when the run evaluates) the validation split has a window.
    One dataset must hold a global batch of training windows; blended ones at least one window
    each, and the same tokenizer (their token ids must mean the same tokens). `hint`: how to
    prepare a directory that is not (the run's own command where it knows it)."""
    first_tokenizer = None
    for data_dir in data_dirs:
        read_meta(data_dir, hint)
        train, val = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
        check_vocab(train.meta["vocab_size"], model_vocab)
        need = global_batch_size if len(data_dirs) == 1 else 1
        if train.num_samples(seq_len) < need:
            raise DataError(too_few_train_samples(global_batch_size, train.num_samples(seq_len))
                            if need > 1 else f"data.blend: {data_dir} has no training window of "
                            f"train.seq_len + 1 = {seq_len + 1} tokens; prepare more data")
        if evaluates and val.num_samples(seq_len) == 0:
            raise DataError(_no_val_window(seq_len))
        fingerprint = tokenizer_fingerprint(data_dir, train.meta)
        if first_tokenizer is None:
            first_tokenizer = (data_dir, fingerprint)
        elif fingerprint != first_tokenizer[1]:
            raise DataError(f"data.blend: {data_dir} was tokenized with another tokenizer than "
                            f"{first_tokenizer[0]}; prepare every blended dataset with the same "
                            "data.tokenizer (e.g. gpt2)")


def tokenizer_fingerprint(data_dir: Path, meta: dict) -> str:
    """What identifies the tokenizer of a prepared directory: a hash of its saved tokenizer
    files, with the vocabulary size and EOS id."""
    digest = hashlib.sha256(f"{meta['vocab_size']}/{meta.get('eos_token_id')}".encode())
    tok_dir = Path(data_dir) / meta.get("tokenizer", {}).get("dir", "tokenizer")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        if (tok_dir / name).is_file():
            digest.update(name.encode() + (tok_dir / name).read_bytes())
    return digest.hexdigest()


def _no_val_window(seq_len: int) -> str:
    return (f"train.seq_len={seq_len}: the validation split has no window of {seq_len + 1} "
            "tokens; lower train.seq_len, raise data.val_fraction, or set train.eval_every=0")


def val_batches(sources: Sequence[TokenShards], micro_batch_size: int, seq_len: int,
                eval_steps: int, global_batch_size: int, dp_rank: int, dp_size: int,
                device: torch.device, weights: Optional[Sequence[float]] = None,
                reads: Tuple[bool, bool] = (True, True),
                documents: Optional[DocumentRule] = None, cp: Tuple[int, int] = (1, 0)
                ) -> List[tuple]:
    """A fixed validation set, the same whatever the layout: `eval_steps` global batches of
    windows 0, 1, 2, ... (wrapping) in order; DP rank d takes the d-th contiguous slice of each
    global batch, in micro-batches. The mean loss over all ranks is the serial run's.

    `sources` holds one TokenShards per dataset; for a blend, with their `weights`, position p
    takes its dataset from the greedy blend and that dataset's next window in order. `reads`:
    as for `TrainBatches` (a middle pipeline stage reads no token), `documents` and `cp`."""
    sizes = [s.num_samples(seq_len) for s in sources]
    if min(sizes) == 0:
        raise DataError(_no_val_window(seq_len))
    total = global_batch_size * eval_steps
    choices = blend_choices(weights or [1.0], [0] * len(sources), total)
    taken = [0] * len(sources)
    pairs = []
    for d in choices:
        pairs.append((d, taken[d] % sizes[d]))
        taken[d] += 1
    per_rank = global_batch_size // dp_size
    positions = [k * global_batch_size + dp_rank * per_rank + j
                 for k in range(eval_steps) for j in range(per_rank)]
    if not any(reads) and documents is None:
        return [(None, None)] * (len(positions) // micro_batch_size)
    datasets = np.array([pairs[p][0] for p in positions], dtype=np.int64)
    windows = read_windows(sources, datasets, np.array([pairs[p][1] for p in positions],
                                                        dtype=np.int64), seq_len)
    return [_to_batch(windows[j:j + micro_batch_size], device, reads, documents, cp)
            for j in range(0, len(windows), micro_batch_size)]
