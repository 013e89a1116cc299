"""Writing token shards so that a killed preparation resumes from its last complete shard.

A shard is appended to `<split>_00007.bin.partial`; when it holds `shard_tokens` tokens it is
flushed, fsynced and renamed to `<split>_00007.bin` (the directory fsynced too), so a file with a
shard's final name is always whole. Each writer keeps a CRC32 of every shard as it writes it.

`progress.json` (the manifest) lists, per split, the complete shards with their token counts
and CRC32s, the partial shard's length and CRC32, and how many source documents are fully
written. It is rewritten (temp file, fsync, rename) after every batch of documents in which a
shard was completed, once every byte it describes is on disk. A resumed preparation checks
every listed shard (size and CRC32), cuts the partial shard back to its listed length (what was
appended after the manifest is written again), deletes any later file, and goes on from the
listed document.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import List, Optional

import numpy as np

from megalite.data.errors import DataError
from megalite.utils.durable import fsync_dir

MANIFEST = "progress.json"
PARTIAL = ".partial"


def file_crc32(path: Path, nbytes: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        while nbytes > 0:
            chunk = f.read(min(nbytes, 1 << 24))
            if not chunk:
                break
            crc, nbytes = zlib.crc32(chunk, crc), nbytes - len(chunk)
    return crc


class ShardWriter:
    """Appends token ids to `<split>_00000.bin, ...`, at most `shard_tokens` per file; `state`
    and `resume` carry it across a restart."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype = Path(out_dir), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.entries: List[dict] = []  # complete shards: file, tokens, crc32
        self.partial: Optional[dict] = None  # the shard being written: file, tokens, crc32
        self.shards_completed = 0  # since the last `state()`
        self._file = None

    def _name(self, index: int) -> str:
        return f"{self.split}_{index:05d}.bin"

    def _open_next(self) -> None:
        name = self._name(len(self.entries))
        self._file = open(self.out_dir / (name + PARTIAL), "wb")
        self.partial = {"file": name, "tokens": 0, "crc32": 0}

    def _finish_shard(self) -> None:
        """The partial shard, whole: flushed, fsynced, renamed to its final name."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        name = self.partial["file"]
        os.replace(self.out_dir / (name + PARTIAL), self.out_dir / name)
        fsync_dir(self.out_dir)
        self.entries.append(self.partial)
        self.partial = None
        self.shards_completed += 1

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise DataError(f"token id out of range for {self.dtype.name} shards")
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._open_next()
            room = self.shard_tokens - self.partial["tokens"]
            chunk, tokens = tokens[:room], tokens[room:]
            data = chunk.tobytes()
            self._file.write(data)
            self.partial["tokens"] += int(chunk.size)
            self.partial["crc32"] = zlib.crc32(data, self.partial["crc32"])
            if self.partial["tokens"] == self.shard_tokens:
                self._finish_shard()

    def sync(self) -> None:
        """Everything written so far is on disk (before a manifest describes it)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def state(self) -> dict:
        self.shards_completed = 0
        return {"shards": [dict(e) for e in self.entries],
                "partial": dict(self.partial) if self.partial else None}

    def close(self) -> List[dict]:
        """Finishes the last (short) shard; the list of shards, for meta.json."""
        if self._file is not None:
            self._finish_shard()
        return self.entries

    @classmethod
    def resume(cls, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int,
               state: dict) -> "ShardWriter":
        """The writer of `state` (from the manifest), after checking the files it lists."""
        writer = cls(out_dir, split, dtype, shard_tokens)
        itemsize = writer.dtype.itemsize
        for entry in state["shards"]:
            _check_file(writer.out_dir / entry["file"], entry, itemsize, exact=True)
            writer.entries.append(dict(entry))
        keep = {e["file"] for e in writer.entries}
        partial = state["partial"]
        if partial is not None:
            path = writer.out_dir / (partial["file"] + PARTIAL)
            whole = writer.out_dir / partial["file"]
            if not path.exists() and whole.exists():  # completed after the manifest was written
                os.replace(whole, path)
            _check_file(path, partial, itemsize, exact=False)
            with open(path, "r+b") as f:
                f.truncate(partial["tokens"] * itemsize)
            writer._file = open(path, "ab")
            writer.partial = dict(partial)
            keep.add(partial["file"] + PARTIAL)
        for stale in writer.out_dir.glob(f"{split}_*.bin*"):
            if stale.name not in keep:
                stale.unlink()
        return writer


def _check_file(path: Path, entry: dict, itemsize: int, exact: bool) -> None:
    """The first entry["tokens"] tokens of `path` are those the manifest recorded."""
    nbytes = entry["tokens"] * itemsize
    hint = ("the interrupted preparation cannot be resumed; delete its directory "
            f"{path.parent} to start over")
    if not path.is_file():
        raise DataError(f"{path}: listed in {MANIFEST} but missing; {hint}")
    size = path.stat().st_size
    if size < nbytes or (exact and size != nbytes):
        raise DataError(f"{path}: {size} bytes, {MANIFEST} lists {entry['tokens']} tokens "
                        f"({nbytes} bytes); {hint}")
    if file_crc32(path, nbytes) != entry["crc32"]:
        raise DataError(f"{path}: its CRC32 differs from the one {MANIFEST} lists (the file "
                        f"changed since it was written); {hint}")


def write_json(path: Path, obj: dict) -> None:
    """`path` replaced whole or not at all: a temp file, fsynced, renamed (directory fsynced)."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_manifest(out_dir: Path) -> Optional[dict]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:  # cannot happen through write_manifest's rename
        raise DataError(f"{path}: not valid JSON ({e}); delete {out_dir} to start over") from e
