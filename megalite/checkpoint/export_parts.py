"""The parts of one `transformers` export (`megalite-export --part I/N`, N processes sharing
OUT_DIR) agree on what they export, and join no other export's files.

An export is named by its id (`export_id`): a hash of the checkpoint's meta.json and step
directory name, the shard size and the number of parts. Every shard carries the id in its
safetensors metadata (`checkpoint.hf_stream`), and a part refuses an OUT_DIR holding a shard
without it: the files of an export that stopped midway, of another checkpoint or another shard
size, are never indexed as this one's.

The first part to start records the export in `OUT_DIR/.megalite-export.json` (created once,
atomically: written aside, then hard-linked into place, which fails where the file exists);
the others read it. Parts given a checkpoint directory (`checkpoint.dir`) export the step it
records, whichever is the latest when they start, so a save landing between the parts' starts
cannot split the export over two steps; a part whose checkpoint or options give another id is
refused. The part that completes the export deletes the record before writing the index.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Optional, Tuple

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.resolve import resolve_checkpoint

RECORD = ".megalite-export.json"
EXPORT_KEY = "megalite_export"  # a shard's metadata: the id of the export that wrote it


def export_id(ckpt: Path, max_shard_bytes: int, parts: int) -> str:
    """The id of exporting checkpoint `ckpt` in shards of `max_shard_bytes` by `parts` parts."""
    digest = hashlib.sha256((ckpt / "meta.json").read_bytes())
    digest.update(f"{ckpt.name} {max_shard_bytes} {parts}".encode())
    return digest.hexdigest()[:16]


def shard_export(path: Path) -> Optional[str]:
    """The id of the export that wrote a shard (None: not written by an export of megalite's,
    or not a safetensors file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get(EXPORT_KEY)
    except SafetensorError:
        return None


def check_shards(out_dir: Path, run: str) -> None:
    """Every shard already in `out_dir` is export `run`'s (written by another part of it)."""
    for path in sorted(out_dir.glob("model*.safetensors")):
        if shard_export(path) != run:
            raise CheckpointError(f"{path}: a shard of another export (or of none); the parts "
                                  f"of an export write into a directory of their own (delete "
                                  f"{out_dir}, or pick another)")


def _create_once(path: Path, record: dict) -> None:
    """Write `path` unless it exists; readers never see it half-written."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(record, indent=1))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def _describe(record: dict) -> str:
    return (f"{record['checkpoint']} in shards of at most {record['max_shard_bytes']} bytes by "
            f"{record['parts']} parts")


def pin_checkpoint(given, out_dir: Path, max_shard_bytes: int, parts: int) -> Tuple[Path, str]:
    """The checkpoint this part exports and the export's id: `given` where it is one
    checkpoint, else the step of checkpoint directory `given` the export records (the latest
    when the first part started). Refuses an export whose record names another."""
    given = Path(given)
    ckpt = resolve_checkpoint(given)
    one = ckpt == given
    if not (out_dir / RECORD).exists():  # a part refused here leaves no record behind
        check_shards(out_dir, export_id(ckpt, max_shard_bytes, parts))
        _create_once(out_dir / RECORD, {"checkpoint": str(ckpt.resolve()), "step": ckpt.name,
                                        "max_shard_bytes": max_shard_bytes, "parts": parts,
                                        "id": export_id(ckpt, max_shard_bytes, parts)})
    record = json.loads((out_dir / RECORD).read_text())
    if not one and record["step"] != ckpt.name:
        ckpt = given / record["step"]
        if not (ckpt / "meta.json").is_file():
            raise CheckpointError(f"{out_dir}: its parts export {record['checkpoint']}, and "
                                  f"{given} holds no complete {record['step']}; give every "
                                  "part the same checkpoint")
    run = export_id(ckpt, max_shard_bytes, parts)
    if run != record["id"]:
        raise CheckpointError(
            f"{out_dir}: holds the parts of another export ({_describe(record)}); this part "
            f"exports {ckpt} in shards of at most {max_shard_bytes} bytes by {parts} parts. "
            "Give every part the same checkpoint step_N, --max-shard-size and N, or a new "
            f"directory (delete {out_dir} to drop the other export's files)")
    return ckpt, run


def release(out_dir: Path) -> None:
    """The export is complete: its record goes (the index, written next, marks it done)."""
    (out_dir / RECORD).unlink(missing_ok=True)
