"""Loading at scale: start-up time and memory of one rank's loader against corpus size, the old
sample order ("permutation-v1": a permutation of every window built at each epoch start) side by
side with the new one ("bijection-v1": a Feistel bijection evaluated per position), and the
open files at 2,000 shards against megalite's loader before issue 19 (a memmap per shard).

Corpora are synthetic: per size, a data directory of sparse shard files (`--shard-tokens`
tokens each, no disk blocks: reads return zeros) and its meta.json, so the loader runs as in
training — meta.json read, every shard's size checked, the sampler built, this rank's slice of
the first global batch drawn and its windows read. Reported per order: that start-up's wall
time (and its parts: the shards checked; the sampler built and the first slice drawn) and the
peak of memory allocated meanwhile (tracemalloc: numpy's arrays included); then the median time
of drawing and reading one later global batch slice (`--global-batch` / `--dp` windows), of
finding the documents of those windows from their EOS tokens as train.attention_mask=document
with reset positions and eos_loss=false does ("docs ms": `megalite.data.documents`, per window
as it is loaded; nothing at start-up), and of the order's lookup alone for a whole global batch
of positions ("order us"). The old order
builds its permutation again at every epoch start: its start-up time is also the stall at each
epoch boundary. `--old-max` caps the sizes the old order runs at (it holds 8 bytes per window:
8 GB at 1e9).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import List

import numpy as np

from megalite.data.documents import DocumentRule
from megalite.data.files import ShardFiles, open_descriptors, open_file_budget
from megalite.data.loader import META_FILE, TokenShards, read_windows
from megalite.data.order import ORDERS
from megalite.data.sampler import ResumableSampler


def add_arguments(p) -> None:
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e9],
                   help="corpus sizes in windows (default: 1e6 1e7 1e8 1e9)")
    p.add_argument("--old-max", type=float, default=1e8,
                   help="largest size the old order runs at (default 1e8; 1e9 takes 8 GB)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--dp", type=int, default=8, help="DP size: a rank draws 1/dp of a batch")
    p.add_argument("--batches", type=int, default=20, help="later batches timed per case")
    p.add_argument("--shards", type=int, default=2000, help="shards of the open-file case")
    p.add_argument("--fd-limit", type=int, default=256,
                   help="the lowered soft open-file limit of the open-file case")
    p.add_argument("--dir", default=None, help="where the sparse corpora go (default: a "
                   "temporary directory)")


def write_sparse_corpus(path: Path, windows: int, seq_len: int, shard_tokens: int) -> Path:
    """A data directory whose train split holds `windows` windows in sparse shards."""
    path.mkdir(parents=True)
    per_shard = (shard_tokens - 1) // seq_len
    entries, left = [], windows
    while left > 0:
        take = min(left, per_shard)
        name, tokens = f"train_{len(entries):05d}.bin", take * seq_len + 1
        with open(path / name, "wb") as f:
            f.truncate(tokens * 2)
        entries.append({"file": name, "tokens": tokens})
        left -= take
    with open(path / "val_00000.bin", "wb") as f:
        f.truncate((seq_len + 1) * 2)
    splits = {"train": {"shards": entries, "tokens": sum(e["tokens"] for e in entries),
                        "documents": 1},
              "val": {"shards": [{"file": "val_00000.bin", "tokens": seq_len + 1}],
                      "tokens": seq_len + 1, "documents": 1}}
    meta = {"format_version": 1, "vocab_size": 50257, "eos_token_id": 50256, "dtype": "uint16",
            "splits": splits}
    (path / META_FILE).write_text(json.dumps(meta))
    return path


def _draw(shards: TokenShards, sampler: ResumableSampler, seq_len: int) -> np.ndarray:
    datasets, windows = sampler.next_windows()
    return read_windows([shards], datasets, windows, seq_len)


def _one_case(data: Path, order: str, args) -> dict:
    """Start-up — shards checked against meta.json, the sampler built and this rank's slice of
    the first batch drawn, its windows read — then later batches (drawn and read)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    shards = TokenShards(data, "train", ShardFiles(64))
    n = shards.num_samples(args.seq_len)
    t1 = time.perf_counter()
    sampler = ResumableSampler(n, args.global_batch, dp_rank=args.dp - 1, dp_size=args.dp,
                               seed=1234, order=order)
    datasets, windows = sampler.next_windows()
    t2 = time.perf_counter()
    read_windows([shards], datasets, windows, args.seq_len)
    t3 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times, lookups, documents = [], [], []
    rule = DocumentRule(shards.meta["eos_token_id"], reset_positions=True, eos_loss=False)
    for _ in range(args.batches):
        t = time.perf_counter()
        tokens = _draw(shards, sampler, args.seq_len)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        rule.of(tokens[:, :-1])
        documents.append(time.perf_counter() - t)
        positions = np.arange(sampler.consumed_samples, sampler.consumed_samples
                              + args.global_batch)  # a whole global batch's windows
        t = time.perf_counter()
        sampler.order.windows(positions)
        lookups.append(time.perf_counter() - t)
    shards.files.close()
    return {"startup_s": t3 - t0, "shards_s": t1 - t0, "sampler_s": t2 - t1,
            "peak_bytes": peak, "batch_ms": 1e3 * statistics.median(times),
            "docs_ms": 1e3 * statistics.median(documents),
            "order_us": 1e6 * statistics.median(lookups)}


def _open_files_case(args, root: Path) -> List[dict]:
    """Open descriptors while reading batches of a `--shards`-shard corpus: main's loader (a
    memmap per shard, as before issue 19) against ShardFiles under the machine's limit and
    under a soft limit of `--fd-limit` (2 x `--batches` batches; the second half timed)."""
    per_shard = max(4, -(-args.global_batch // args.shards))  # a global batch at least
    data = write_sparse_corpus(root / "fds", args.shards * per_shard, args.seq_len,
                               per_shard * args.seq_len + 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    rows = []
    base = open_descriptors()
    maps = [np.memmap(p, dtype=np.uint16, mode="r")
            for p in TokenShards(data, "train").paths] if soft > args.shards + 64 else []
    rows.append({"loader": "memmap per shard (before)", "soft_limit": soft,
                 "open": open_descriptors() - base if maps else None})
    del maps
    for limit in (soft, args.fd_limit):
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            files = ShardFiles(open_file_budget())
            shards = TokenShards(data, "train", files)
            sampler = ResumableSampler(shards.num_samples(args.seq_len), args.global_batch,
                                       0, 1, seed=1234)
            most, seconds = 0, 0.0
            for i in range(2 * args.batches):  # the first half warms the descriptor cache
                t0 = time.perf_counter()
                _draw(shards, sampler, args.seq_len)
                seconds += (time.perf_counter() - t0) if i >= args.batches else 0.0
                most = max(most, open_descriptors() - base)
            per_window = seconds / (args.batches * args.global_batch)
            rows.append({"loader": f"ShardFiles({files.capacity})", "soft_limit": limit,
                         "open": most, "read_us_per_window": 1e6 * per_window})
            files.close()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return rows


def run(args) -> dict:
    root = Path(args.dir or tempfile.mkdtemp(prefix="megalite-bench-loader-"))
    per_rank = args.global_batch // args.dp
    print(f"seq_len={args.seq_len}, {args.shard_tokens:,} tokens per shard, global batch "
          f"{args.global_batch} over dp {args.dp} ({per_rank} windows per rank), pid "
          f"{os.getpid()}", flush=True)
    print(f"{'windows':>8} {'shards':>7} {'order':>15} {'start-up s':>11} {'(shards s':>10} "
          f"{'sampler s)':>11} {'peak MiB':>9} {'batch ms':>9} {'docs ms':>8} {'order us':>9}",
          flush=True)
    results = {"sizes": [], "open_files": []}
    try:
        for size in args.sizes:
            n = int(size)
            data = write_sparse_corpus(root / f"n{n}", n, args.seq_len, args.shard_tokens)
            shards = len(TokenShards(data, "train").paths)
            for order in ORDERS:
                if order == ORDERS[0] and n > args.old_max:
                    print(f"{n:>8.0e} {shards:>7} {order:>15}  (skipped: above --old-max)")
                    continue
                r = {"windows": n, "shards": shards, "order": order, **_one_case(data, order, args)}
                results["sizes"].append(r)
                print(f"{n:>8.0e} {shards:>7} {order:>15} {r['startup_s']:>11.3f} "
                      f"{r['shards_s']:>10.3f} {r['sampler_s']:>11.4f} "
                      f"{r['peak_bytes'] / 2**20:>9.2f} {r['batch_ms']:>9.3f} "
                      f"{r['docs_ms']:>8.3f} {r['order_us']:>9.1f}", flush=True)
            shutil.rmtree(data)
        results["open_files"] = _open_files_case(args, root)
        print(f"\nopen descriptors while reading {2 * args.batches} batches of {args.global_batch} "
              f"windows from {args.shards} shards:")
        for row in results["open_files"]:
            extra = (f", {row['read_us_per_window']:.1f} us per window read"
                     if "read_us_per_window" in row else "")
            print(f"  {row['loader']:<28} soft limit {row['soft_limit']:>6}: "
                  f"{row['open'] if row['open'] is not None else 'n/a (limit too low)'} open"
                  f"{extra}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return results
