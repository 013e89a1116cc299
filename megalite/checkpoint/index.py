"""The piece index of a checkpoint: where each piece of each global tensor lies, per tensor.

Format 5 writes one small JSON file per global tensor, `index/<tensor name>.json`:

    {"spec": {shape, tp_dim, tp_interleave, padded_rows, tp},   # how the writer cut it
     "pieces": {kind: [[tp_rank, lo, hi, file, offset], ...]}}

and meta.json lists each one with its size and CRC32 under "tensors". A resuming rank reads and
checks only the index files of the tensors it owns part of: at 4,096 ranks (gpt2-xl, pp 2,
zero 3) the whole index is tens of MB, which formats 3-4 kept in meta.json ("pieces", one
record per piece) for every rank to parse. Those still load: their index is split by tensor
here on reading.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import numpy as np

from megalite.checkpoint.errors import CheckpointError
from megalite.parallel.param_spec import ParamSpec

INDEX_DIR = "index"


class Piece(NamedTuple):
    tp_rank: int
    lo: int
    hi: int
    file: str
    offset: int


def spec_record(spec: ParamSpec, tp: int) -> dict:
    """How the writer cut a tensor; `tp_replicas` only where TP ranks share slices (a key an
    older reader would ignore, but it reads no model that has such tensors)."""
    record = {"shape": list(spec.shape), "tp_dim": spec.tp_dim,
              "tp_interleave": spec.tp_interleave, "padded_rows": spec.padded_rows, "tp": tp}
    if spec.tp_replicas > 1:
        record["tp_replicas"] = spec.tp_replicas
    return record


@dataclass
class TensorIndex:
    """The pieces of one global tensor, by kind, as the writer cut them."""
    name: str
    spec: ParamSpec  # the writer's spec
    tp: int  # the writer's TP size
    pieces: Dict[str, List[Piece]]

    @classmethod
    def from_record(cls, name: str, record: dict) -> "TensorIndex":
        rec = record["spec"]
        spec = ParamSpec(name, tuple(rec["shape"]), rec["tp_dim"], rec["tp_interleave"],
                         rec["padded_rows"], tp_replicas=rec.get("tp_replicas", 1))
        pieces = {kind: sorted(Piece(*p) for p in ps) for kind, ps in record["pieces"].items()}
        return cls(name, spec, rec["tp"], pieces)

    def of_rank(self, kind: str, tp_rank: int) -> List[Piece]:
        return [p for p in self.pieces[kind] if p.tp_rank == tp_rank]

    def check(self, files: dict, where: Path) -> None:
        """Every piece lies inside its file, and each TP slice of each kind is covered by its
        pieces without a gap, so reading cannot fail halfway (after the ranks agreed)."""
        numel = int(np.prod(self.spec.local_shape(self.tp)))
        for kind, pieces in self.pieces.items():
            for rank in writer_ranks(self.spec, self.tp):
                end = 0
                for p in (p for p in pieces if p.tp_rank == rank):
                    size = files.get(p.file, {}).get("bytes", -1)
                    if p.lo > end or p.offset + 4 * (p.hi - p.lo) > size:
                        break
                    end = max(end, p.hi)
                if end < numel:
                    raise CheckpointError(f"{where}: the pieces of {self.name} ({kind}, TP "
                                          f"rank {rank}) do not cover it or lie outside their "
                                          "file")


def writer_ranks(spec: ParamSpec, tp: int) -> range:
    """The TP ranks that wrote a tensor's slices (`ParamSpec.tp_writer`)."""
    return range(0, tp, spec.tp_replicas) if spec.tp_dim is not None else range(1)


def index_records(pieces: List[dict]) -> Dict[str, dict]:
    """Per tensor name, its index record, from the pieces every rank reported
    ({name, kind, tp_rank, lo, hi, file, offset, spec})."""
    records: Dict[str, dict] = {}
    for p in pieces:
        rec = records.setdefault(p["name"], {"spec": p["spec"], "pieces": {}})
        rec["pieces"].setdefault(p["kind"], []).append(
            [p["tp_rank"], p["lo"], p["hi"], p["file"], p["offset"]])
    return records


def write_index(tmp: Path, pieces: List[dict]) -> Dict[str, dict]:
    """Format 5: one index file per tensor under `tmp/index/` (fsynced); returns meta.json's
    "tensors" entry (each file's path, size and CRC32)."""
    (tmp / INDEX_DIR).mkdir()
    listing = {}
    for name, record in index_records(pieces).items():
        raw = json.dumps(record).encode()
        rel = f"{INDEX_DIR}/{name}.json"
        with open(tmp / rel, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        listing[name] = {"index": rel, "bytes": len(raw), "crc32": zlib.crc32(raw)}
    return listing


class Index:
    """A checkpoint's index, read lazily per tensor (format 5) or split from meta.json's
    "pieces" (formats 3-4); every tensor's index is checked when first read."""

    def __init__(self, ckpt: Path, meta: dict):
        self.ckpt, self.files = ckpt, meta["files"]
        self._listing: Optional[dict] = meta.get("tensors")
        self._records: Dict[str, dict] = {} if self._listing is not None else \
            index_records(meta["pieces"])
        self._read: Dict[str, TensorIndex] = {}

    def names(self) -> List[str]:
        return sorted(self._listing if self._listing is not None else self._records)

    def __contains__(self, name: str) -> bool:
        return name in (self._listing if self._listing is not None else self._records)

    def tensor(self, name: str) -> TensorIndex:
        if name not in self._read:
            if name not in self:
                raise CheckpointError(f"{self.ckpt}: has no tensor {name}")
            record = self._records.get(name) or self._load(name)
            index = TensorIndex.from_record(name, record)
            index.check(self.files, self.ckpt)
            self._read[name] = index
        return self._read[name]

    def _load(self, name: str) -> dict:
        entry = self._listing[name]
        path = self.ckpt / entry["index"]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: missing or unreadable ({e})") from e
        if len(raw) != entry["bytes"] or zlib.crc32(raw) != entry["crc32"]:
            raise CheckpointError(f"{path}: does not match its size and CRC32 in "
                                  f"{self.ckpt / 'meta.json'} (corrupted)")
        return json.loads(raw)
