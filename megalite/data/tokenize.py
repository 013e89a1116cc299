"""Tokenizing batches of documents, in this process or in a pool of `num_proc` processes.

Each batch of documents (index of its first document, texts) becomes, per split, the
concatenation of its documents' token ids, each document followed by EOS. A document's split is
a function of its index alone (`is_validation`: a seeded 64-bit hash of the index against
val_fraction), so the split of a document never depends on how many documents come after it:
streaming and downloaded preparations, and a resumed one, agree document by document.

The tokenizer runs as its Rust `tokenizers.Tokenizer` (`encode_batch_fast`: no offsets), one
thread per process; special tokens written in a document ("<|endoftext|>" in a web page) are
encoded as text, never as the EOS separator (tiktoken's `encode_ordinary`). Batches go to the
pool in order and come back in order, so the shards do not depend on num_proc.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from megalite.data.errors import DataError

SPLIT_SEED = 0x6D65676174  # fixed: part of the data format (meta.json records it)
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)

Batch = Tuple[int, List[str]]
# per split: (token ids of the batch's documents of that split, number of those documents)
Tokenized = Dict[str, Tuple[np.ndarray, int]]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of uint64 whose outputs look
    independent and uniform for consecutive inputs."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def is_validation(indices: np.ndarray, val_fraction: float, seed: int = SPLIT_SEED
                  ) -> np.ndarray:
    """Whether each document index belongs to the validation split: the top 53 bits of
    splitmix64(seed XOR index), as a uniform number in [0, 1), below val_fraction."""
    h = _splitmix64(np.asarray(indices, dtype=np.uint64) ^ np.uint64(seed))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 < val_fraction


class BatchTokenizer:
    """Turns a batch of documents into per-split token arrays (picklable: the tokenizer travels
    as its JSON)."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str, val_fraction: float):
        self.tokenizer_json, self.eos_id = tokenizer_json, eos_id
        self.dtype, self.val_fraction = np.dtype(dtype), val_fraction
        self._tok = None

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}

    def _tokenizer(self):
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(self.tokenizer_json)
            self._tok.encode_special_tokens = True
        return self._tok

    def __call__(self, batch: Batch) -> Tokenized:
        start, texts = batch
        val = is_validation(np.arange(start, start + len(texts)), self.val_fraction)
        kept = [i for i, t in enumerate(texts) if t]
        encodings = self._tokenizer().encode_batch_fast([texts[i] for i in kept],
                                                        add_special_tokens=False)
        ids = {"train": [], "val": []}
        for i, enc in zip(kept, encodings):
            doc = ids["val" if val[i] else "train"]
            doc.extend(enc.ids)
            doc.append(self.eos_id)
        counts = {"train": int((~val[kept]).sum()) if kept else 0,
                  "val": int(val[kept].sum()) if kept else 0}
        return {split: (np.array(ids[split], dtype=self.dtype), counts[split]) for split in ids}


_WORKER_TOKENIZER: Optional[BatchTokenizer] = None  # a worker process's own, built once


def _start_worker(tokenize: BatchTokenizer) -> None:
    """A tokenizer process starts: it builds the tokenizer once (a batch then travels alone,
    not with the tokenizer's JSON to rebuild it per batch: 62 ms for a 50,257-token BPE) and
    runs it on one thread, the processes being the parallelism."""
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenize._tokenizer()
    _WORKER_TOKENIZER = tokenize


def _tokenize_in_worker(batch: Batch) -> Tokenized:
    return _WORKER_TOKENIZER(batch)


def tokenized_batches(batches: Iterable[Batch], tokenize: BatchTokenizer, num_proc: int
                      ) -> Iterator[Tuple[int, Tokenized]]:
    """(number of documents in the batch, its tokens) for each batch, in order; num_proc > 1
    tokenizes in that many forked processes, with at most 2 * num_proc batches in flight
    (`Pool.imap` would read the whole source ahead into memory). Forked, not spawned: a child
    needs no importable `__main__` (a notebook, `python -`), and a child that dies (killed for
    memory) fails the preparation, which then resumes, instead of hanging a Pool."""
    if num_proc <= 1:
        for batch in batches:
            yield len(batch[1]), tokenize(batch)
        return
    in_flight: Deque = deque()
    context = multiprocessing.get_context("fork")
    try:
        with ProcessPoolExecutor(num_proc, mp_context=context, initializer=_start_worker,
                                 initargs=(tokenize,)) as pool:
            for batch in batches:
                in_flight.append((len(batch[1]), pool.submit(_tokenize_in_worker, batch)))
                if len(in_flight) >= 2 * num_proc:
                    size, result = in_flight.popleft()
                    yield size, result.result()
            while in_flight:
                size, result = in_flight.popleft()
                yield size, result.result()
    except BrokenProcessPool as e:
        raise DataError(f"data.num_proc={num_proc}: a tokenizer process died ({e}; out of "
                        "memory?); run the preparation again to resume it, with fewer "
                        "processes if memory is short") from e
