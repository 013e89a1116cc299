"""The streaming `transformers` export's peak memory against its shard size, on a model that
does not fit the memory it is given:

    python scripts/bench.py hf-export --preset llama3.2-1b --shard-mb 128 512 --cap-gib 4

First a serial checkpoint of the preset is written to --dir: its fp32 master weights only
(4 bytes a parameter; random values, 64 MiB at a time, with the per-MiB CRC32s and the piece
index `checkpoint.save` writes), so it costs disk, not memory. Then each export runs in a fresh
process under RLIMIT_AS = --cap-gib (address space: the whole fp32 model cannot be held) and
reports its peak RSS (ru_maxrss), time and shard count; next to it, under the same cap, the
whole-model read the export did before (`read_global_state`), which is expected to fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from megalite.checkpoint.format import FORMAT_VERSION, meta_crc32
from megalite.checkpoint.index import spec_record, write_index
from megalite.checkpoint.save import BlockCRC
from megalite.config.schema import load_config
from megalite.model.families import causal_lm

CHUNK = 2**24  # elements written at a time (64 MiB)
# the child: an export (or the whole read) under the address-space cap, its peak RSS as JSON
CHILD = """
import json, resource, sys, time
cap, mode, ckpt, out, shard, tok = int(sys.argv[1]), *sys.argv[2:5], int(sys.argv[5]), sys.argv[6]
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import safetensors.torch, transformers  # imported in every mode: the floor
from megalite.checkpoint.export import export_hf
from megalite.checkpoint.format import read_global_state
start, error = time.perf_counter(), None
try:
    if mode == "stream":
        export_hf(ckpt, out, tokenizer=tok, max_shard_bytes=shard)
    elif mode == "whole":
        read_global_state(ckpt)
except MemoryError as e:
    error = f"MemoryError: {e}"
print(json.dumps({"seconds": time.perf_counter() - start, "error": error,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_checkpoint(preset: str, root: Path) -> Path:
    """A complete serial megalite checkpoint of `preset`'s weights, random fp32, streamed."""
    cfg = load_config([f"model={preset}", "data.dir=."])
    with torch.device("meta"):
        specs = [s for s in causal_lm(cfg.model).param_specs.values() if not s.tied_copy]
    ckpt = root / "step_00000000"
    ckpt.mkdir(parents=True)
    crc, pieces, offset = BlockCRC(2**20), [], 0
    gen = torch.Generator().manual_seed(0)
    with open(ckpt / "rank00000.bin", "wb") as f:
        for spec in specs:
            numel = int(torch.Size(spec.shape).numel())
            for lo in range(0, numel, CHUNK):
                raw = (torch.randn(min(CHUNK, numel - lo), generator=gen) * 0.02).numpy().data
                f.write(raw)
                crc.update(raw.cast("B"))
            pieces.append({"name": spec.name, "kind": "param", "tp_rank": 0, "lo": 0,
                           "hi": numel, "file": "rank00000.bin", "offset": offset,
                           "spec": spec_record(spec, 1)})
            offset += 4 * numel
    meta = {"format_version": FORMAT_VERSION, "model": asdict(cfg.model), "data_dir": ".",
            "files": {"rank00000.bin": crc.record()}, "tensors": write_index(ckpt, pieces)}
    meta["meta_crc32"] = meta_crc32(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def _child(cap: int, mode: str, ckpt: Path, out: Path, shard: int, tokenizer: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cap), mode, str(ckpt), str(out),
                           str(shard), str(tokenizer)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args) -> list:
    root = Path(args.dir or tempfile.mkdtemp(prefix="megalite-hf-export-"))
    start = time.perf_counter()
    ckpt = write_checkpoint(args.preset, root / "ckpt")
    model_bytes = (ckpt / "rank00000.bin").stat().st_size
    print(f"checkpoint of {args.preset}: {model_bytes / 2**30:.2f} GiB of fp32 weights written "
          f"in {time.perf_counter() - start:.0f} s; cap {args.cap_gib} GiB of address space")
    cap = int(args.cap_gib * 2**30)
    tok = Path(args.tokenizer)
    rows = [{"mode": "imports only", **_child(cap, "imports", ckpt, root / "x", 0, tok)},
            {"mode": "whole read (before)", **_child(cap, "whole", ckpt, root / "x", 0, tok)}]
    for mb in args.shard_mb:
        out = root / f"hf_{mb}"
        row = _child(cap, "stream", ckpt, out, mb * 2**20, tok)
        row.update(mode=f"stream, shards <= {mb} MiB",
                   shards=len(list(out.glob("*.safetensors"))) if out.is_dir() else 0)
        rows.append(row)
    for row in rows:
        peak = row.get("peak_rss_bytes")
        print(f"{row['mode']:>26}: peak RSS "
              f"{'-' if peak is None else f'{peak / 2**30:.2f} GiB'}, "
              f"{row.get('seconds', 0):.0f} s, shards {row.get('shards', '-')}, "
              f"error {row.get('error')}")
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--shard-mb", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--cap-gib", type=float, default=4.0)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory whose "
                        "vocabulary fits the preset (e.g. <data.dir>/tokenizer)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
