"""Read the history rows of an offline wandb run back from its `.wandb` transaction log.

wandb >= 0.2x no longer ships a Python reader for its run files (its `datastore` module moved
into the Go `wandb-core`), so this decodes the container — LevelDB-log-style 32 KiB blocks after
a 7-byte ":W&B" header, each chunk [crc32c u32][length u16][type u8] with types FULL / FIRST /
MIDDLE / LAST — and parses every record with wandb's own protobuf schema
(`wandb.proto.wandb_internal_pb2.Record`).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Iterator, List

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")


def history(run_dir: Path) -> List[Dict[str, object]]:
    """History rows ({key: value, "_step": n}) of the one wandb run under `run_dir`."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(run_dir).rglob("*.wandb"))
    assert len(files) == 1, f"expected one .wandb file under {run_dir}, found {files}"
    rows = []
    for raw in records(files[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
