"""Data preparation: tokens/s per process of megalite's preparation against a plain reference,
in the same run, on the same documents and tokenizer, with the token streams checked equal.

Tokenizer: a GPT-2-style byte-level BPE of 50,257 tokens (256 bytes + merges + <|endoftext|>,
GPT-2's vocabulary size) trained here with HF `tokenizers` on the corpus (the GPT-2 tokenizer
itself cannot be downloaded on an offline machine; pass `--tokenizer gpt2` or a directory where
it can). Corpus: this Python's standard-library sources (megalite's `stdlib` preset), as a local
jsonl file read through `datasets` (`data.source=json`).

Reference: the way nanoGPT's `data/openwebtext/prepare.py` (and llm.c's fineweb.py, with a
process pool instead of `map`) prepare data — `datasets.map` with one call per document
(`encode_ordinary(text) + [eot]`, here the same `tokenizers.Tokenizer` with special tokens
encoded as text), `num_proc` processes, then the `ids` column concatenated into one uint16
memmap in batches. Both sides run with one tokenizer thread per process
(TOKENIZERS_PARALLELISM=false); both read the same already-converted Arrow dataset.

Reported per num_proc: tokens, wall seconds, CPU seconds (this process and its reaped worker
processes, from getrusage), tokens/s per process = tokens per CPU second — on a shared machine
wall time mostly measures the other tenants — and the ratio megalite / reference of the latter
(> 1: megalite faster); plus megalite streaming the same file. Best of --repeats, the sides
interleaved.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import List

import numpy as np

from megalite.config.schema import DataConfig
from megalite.data.prepare import prepare, train_tokenizer
from megalite.data.sources import stdlib_files

GPT2_VOCAB = 50257


def add_arguments(parser) -> None:
    parser.add_argument("--documents", type=int, default=None,
                        help="first N standard-library files (default: all)")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer dir or hub id; default: train a 50,257-token "
                             "byte-level BPE on the corpus (cached in --work-dir)")
    parser.add_argument("--work-dir", default=None,
                        help="where the corpus, tokenizer and outputs go (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per side")


def _corpus(work: Path, documents) -> Path:
    path = work / "corpus.jsonl"
    if not path.exists():
        with open(path, "w") as f:
            for p in stdlib_files()[:documents]:
                f.write(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")})
                        + "\n")
    return path


def _tokenizer_dir(work: Path, corpus: Path, name) -> str:
    if name is not None:
        return name
    out = work / f"bpe{GPT2_VOCAB}"
    if not (out / "tokenizer.json").exists():
        t0 = time.perf_counter()
        texts = (json.loads(line)["text"] for line in open(corpus))
        train_tokenizer(texts, GPT2_VOCAB).save_pretrained(out)
        print(f"trained a {GPT2_VOCAB}-token byte-level BPE on {corpus} in "
              f"{time.perf_counter() - t0:.0f}s -> {out}")
    return str(out)


def _reference(corpus: Path, tokenizer_dir: str, num_proc: int, out: Path) -> float:
    """nanoGPT's prepare.py, with this tokenizer: map per document, then one memmap."""
    import datasets
    from tokenizers import Tokenizer

    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    t0 = time.perf_counter()
    enc = Tokenizer.from_file(str(tok_file))
    enc.encode_special_tokens = True  # tiktoken's encode_ordinary
    eot = enc.token_to_id("<|endoftext|>")

    def process(example):
        ids = enc.encode(example["text"], add_special_tokens=False).ids
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    ds = datasets.load_dataset("json", data_files=[str(corpus)], split="train")
    ds = ds.filter(lambda e: bool(e["text"]))
    tokenized = ds.map(process, remove_columns=["text"], num_proc=num_proc if num_proc > 1
                       else None, load_from_cache_file=False, desc="reference tokenize")
    arr_len = int(np.sum(tokenized["len"], dtype=np.uint64))
    arr = np.memmap(out, dtype=np.uint16, mode="w+", shape=(arr_len,))
    total_batches, idx = min(1024, len(tokenized)), 0
    for batch_idx in range(total_batches):
        batch = tokenized.shard(num_shards=total_batches, index=batch_idx,
                                contiguous=True).with_format("numpy")
        arr_batch = np.concatenate(batch["ids"])
        arr[idx:idx + len(arr_batch)] = arr_batch
        idx += len(arr_batch)
    arr.flush()
    return time.perf_counter() - t0


def _megalite(corpus: Path, tokenizer_dir: str, num_proc: int, out: Path, streaming: bool
              ) -> float:
    cfg = DataConfig(source="json", data_files=[str(corpus)], tokenizer=tokenizer_dir,
                     val_fraction=0.0, num_proc=num_proc, shard_tokens=10**12,
                     streaming=streaming)
    t0 = time.perf_counter()
    prepare(cfg, out, progress=False)
    return time.perf_counter() - t0


def _stream_bytes(data_dir: Path) -> bytes:
    meta = json.loads((data_dir / "meta.json").read_text())
    return b"".join((data_dir / e["file"]).read_bytes() for e in meta["splits"]["train"]["shards"])


def _cpu_seconds() -> float:
    """User + system CPU of this process and of its finished (reaped) children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _timed(fn, out: Path) -> tuple:
    """(wall seconds, CPU seconds) of fn(out), out removed first."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    cpu = _cpu_seconds()
    wall = fn(out)
    return wall, _cpu_seconds() - cpu


def run(args) -> List[dict]:
    import datasets

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    datasets.disable_progress_bars()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megalite-bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(work, args.documents)
    tok = _tokenizer_dir(work, corpus, args.tokenizer)
    datasets.load_dataset("json", data_files=[str(corpus)], split="train")  # Arrow cache, once
    import transformers  # noqa: F401  (imported once, outside the timings, as datasets is)
    rows = []
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB); tokenizer: {tok}")
    print("| side | num_proc | tokens | wall s | CPU s | tokens/s (wall) | tokens/s per process "
          "(per CPU s) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.num_proc:
        sides = {"reference (datasets.map)": (lambda o: _reference(corpus, tok, p, o), "ref.bin"),
                 "megalite": (lambda o: _megalite(corpus, tok, p, o, False), "ours"),
                 "megalite, streaming": (lambda o: _megalite(corpus, tok, p, o, True), "stream")}
        best = {side: (float("inf"), float("inf")) for side in sides}
        for _ in range(args.repeats):  # interleaved: the machine's load hits every side alike
            for side, (fn, name) in sides.items():
                wall, cpu = _timed(fn, work / name)
                best[side] = (min(best[side][0], wall), min(best[side][1], cpu))
        ref = (work / "ref.bin").read_bytes()
        if _stream_bytes(work / "ours") != ref or _stream_bytes(work / "stream") != ref:
            raise AssertionError(f"num_proc={p}: megalite's token stream differs from the "
                                 "reference's")
        tokens = len(ref) // 2
        ref_cpu = best["reference (datasets.map)"][1]
        for side, (wall, cpu) in best.items():
            row = {"side": side, "num_proc": p, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
                   "tokens_per_s": tokens / wall, "per_process": tokens / cpu,
                   "ratio": ref_cpu / cpu}
            rows.append(row)
            print(f"| {side} | {p} | {tokens:,} | {wall:.1f} | {cpu:.1f} | "
                  f"{row['tokens_per_s']:,.0f} | {row['per_process']:,.0f} | {row['ratio']:.2f} |")
    print("token streams equal: yes")
    return rows
