"""Checkpoint save and load: time and bytes for a preset (default `gpt2`, 124M parameters) at
dp ∈ {1, 2, 4}, and how save time scales with the number of ranks.

Each DP size runs in its own gloo world with zero=1 (dp > 1; zero=0 at dp = 1), so every rank
writes its 1/dp share of the fp32 master weights and both AdamW moments (12 bytes per parameter
in total) in parallel; rank 0 then writes meta.json and publishes the directory. Reported: save
time (from the first rank starting to the directory being published, barrier to barrier),
bytes on disk, write bandwidth, the time to load it back under the same layout (verification
by CRC32 included), and under a different layout (dp -> dp=1, zero=0: every global tensor is
rebuilt from all the pieces). Then the same save in the background (checkpoint.async_save),
twice: the one-off allocation of the staging buffer (at start-up in a run), how long the
caller is blocked at each save (the snapshot into host memory) and how long until the second
checkpoint is published. Paths: --dir (default a temporary directory; put it on the file
system you care about).
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import List

import torch

from megalite.config.schema import load_config
from megalite.testing.spawn import run_ranks


def _directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _build(preset: str, dp: int, zero: int, root: Path, tp: int = 1):
    from megalite.config.layout import Layout
    from megalite.model.gpt2.stage import GPT2
    from megalite.model.init import init_parameters
    from megalite.parallel.topology import build_topology
    from megalite.train.build import build_engine

    cfg = load_config([f"model={preset}", f"zero={zero}", f"tp={tp}", "device=cpu",
                       f"checkpoint.dir={root}"])
    topo = build_topology(tp, 1, dp)
    model = GPT2(cfg.model, topo.tp_group)
    init_parameters(model, seed=0)
    engine = build_engine(cfg, Layout.of(topo, zero_stage=zero), topo, model)
    return cfg, topo, model, engine


def _run_state(rank: int, world: int):
    """A run state as a training run's, at step 1: the progress, a sampler at sample 0 and
    this rank's random streams. Returns (the state, its progress)."""
    from megalite.checkpoint.state import META, RANK, TOP, Part, ProcessRNG, Progress, RunState
    from megalite.data.sampler import ResumableSampler
    from megalite.parallel.rng import RNGTracker

    progress = Progress(step=1)
    rng = ProcessRNG(RNGTracker(0, 0, 0, rank, torch.device("cpu")), 0, progress)
    return RunState([Part("progress", progress, TOP),
                     Part("sampler", ResumableSampler(world, world, rank, world, 0), META),
                     Part("rng", rng, RANK)]), progress


def _save_and_load(rank: int, world: int, preset: str, root: str) -> dict:
    import torch.distributed as dist

    from megalite.checkpoint.async_save import CheckpointSaver
    from megalite.checkpoint.load import load_checkpoint
    from megalite.checkpoint.save import save_checkpoint, written_numel

    root = Path(root)
    zero = 1 if world > 1 else 0
    cfg, topo, model, engine = _build(preset, world, zero, root)
    for piece, _, _ in engine.main_params:  # an optimizer step, so the moments exist
        piece.grad.normal_()
    engine.clip_and_step(1e-4, 1.0)
    state, progress = _run_state(rank, world)
    dist.barrier()
    t0 = time.perf_counter()
    path = save_checkpoint(root, engine, state.capture(), cfg, topo, keep=3)
    save_s = time.perf_counter() - t0
    _, _, _, fresh = _build(preset, world, zero, root)
    dist.barrier()
    t0 = time.perf_counter()
    load_checkpoint(path, fresh, cfg, topo)
    dist.barrier()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    saver = CheckpointSaver(root, cfg, topo, torch.device("cpu"), background=True,
                            state_numel=written_numel(engine, topo))
    staging_s = time.perf_counter() - t0
    blocked, published = [], []
    for step in (2, 3):
        dist.barrier()
        t0 = time.perf_counter()
        progress.step = step
        saver.save(engine, state.capture())
        blocked.append(time.perf_counter() - t0)
        saver.wait()
        dist.barrier()
        published.append(time.perf_counter() - t0)
    saver.close()
    return {"save_s": save_s, "load_s": load_s, "path": str(path),
            "async_staging_s": staging_s, "async_blocked_s": blocked,
            "async_published_s": published[1]}


def _resharded_resume_bytes(rank: int, world: int, preset: str, root: str) -> dict:
    """zero 0 on dp=world saves (each replica writes what zero 1 would give it); it is loaded
    under zero 1 on dp=world (the same ranges: each rank reads its own file) and under tp=2
    zero 1 on dp=world/2 (a changed TP split: each rank reads the runs of its own elements).
    Per layout, the bytes this rank reads and verifies (the CRC blocks its ranges touch),
    next to what the whole files it touches would cost (format 3 verified whole files)."""
    from megalite.checkpoint.format import KINDS
    from megalite.checkpoint.load import load_checkpoint
    from megalite.checkpoint.save import save_checkpoint

    cfg, topo, _, engine = _build(preset, world, 0, Path(root))
    for piece, _, _ in engine.main_params:
        piece.grad.normal_()
    engine.clip_and_step(1e-4, 1.0)
    path = save_checkpoint(Path(root), engine, _run_state(rank, world)[0].capture(), cfg, topo,
                           keep=1)
    del engine
    out = {}
    for name, tp in (("zero1", 1), ("tp2_zero1", 2)):
        cfg1, topo1, _, fresh = _build(preset, world // tp, 1, Path(root), tp=tp)
        share = 4 * len(KINDS) * sum(p.hi - p.lo for p in fresh.state_pieces())
        t0 = time.perf_counter()
        loaded = load_checkpoint(path, fresh, cfg1, topo1)
        load_s = time.perf_counter() - t0
        touched = {f for f, _ in _touched_ranges(path, fresh, topo1)}
        whole = sum(loaded.meta["files"][f]["bytes"] for f in touched)
        out[name] = {"share": share, "verified": loaded.verified_bytes,
                     "read": loaded.read_bytes, "whole_files": whole, "load_s": load_s}
        del fresh
    return out


def _touched_ranges(path: Path, engine, topo) -> list:
    from megalite.checkpoint.format import Reader, read_meta
    from megalite.checkpoint.load import plan_reads

    _, ranges = plan_reads(Reader(path, read_meta(path)), engine, topo)
    return [(f, r) for f, rs in ranges.items() for r in rs]


def _load_serial(rank: int, world: int, preset: str, root: str, path: str) -> float:
    from megalite.checkpoint.load import load_checkpoint

    cfg, topo, _, engine = _build(preset, 1, 0, Path(root))
    t0 = time.perf_counter()
    load_checkpoint(Path(path), engine, cfg, topo)
    return time.perf_counter() - t0


def run(args) -> List[dict]:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="megalite-ckpt-"))
    n_params = None
    rows = []
    for dp in args.dp:
        root = base / f"dp{dp}"
        shutil.rmtree(root, ignore_errors=True)
        res = run_ranks(_save_and_load, dp, args=(args.preset, str(root)), timeout_s=3600)
        path = Path(res[0]["path"])
        size = _directory_bytes(path)
        cross = run_ranks(_load_serial, 1, args=(args.preset, str(root), str(path)),
                          timeout_s=3600)[0] if dp > 1 else None
        save_s = max(r["save_s"] for r in res)
        rows.append({"dp": dp, "bytes": size, "save_s": save_s,
                     "load_s": max(r["load_s"] for r in res), "load_as_dp1_s": cross,
                     "write_gb_s": size / save_s / 1e9,
                     "async_staging_s": max(r["async_staging_s"] for r in res),
                     "async_blocked_s": [max(r["async_blocked_s"][i] for r in res)
                                         for i in range(2)],
                     "async_published_s": max(r["async_published_s"] for r in res)})
        if n_params is None:
            from megalite.model.families import num_parameters

            n_params = num_parameters(load_config([f"model={args.preset}"]).model)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    dp = max(args.dp)
    if dp > 1:
        root = base / "reshard"
        shutil.rmtree(root, ignore_errors=True)
        per_rank = run_ranks(_resharded_resume_bytes, dp, args=(args.preset, str(root)),
                             timeout_s=3600)
        shutil.rmtree(root, ignore_errors=True)
        _print_resharded(per_rank, dp)
    print(f"\ncheckpoint of model={args.preset} ({n_params / 1e6:.0f}M parameters, fp32 master "
          f"+ 2 AdamW moments = {12 * n_params / 2**30:.2f} GiB of state), gloo, 1 thread "
          f"per rank, {base}")
    print(f"{'dp':>3} {'GiB':>6} {'save s':>7} {'GB/s':>6} {'load s':>7} {'load as dp=1 s':>15}"
          f" {'async: staging s':>16} {'blocked s':>11} {'published s':>11}")
    for r in rows:
        cross = f"{r['load_as_dp1_s']:.2f}" if r["load_as_dp1_s"] is not None else "-"
        print(f"{r['dp']:>3} {r['bytes'] / 2**30:>6.2f} {r['save_s']:>7.2f} {r['write_gb_s']:>6.2f} "
              f"{r['load_s']:>7.2f} {cross:>15} {r['async_staging_s']:>16.2f} "
              f"{'/'.join(f'{b:.3f}' for b in r['async_blocked_s']):>11} "
              f"{r['async_published_s']:>11.2f}")
    return rows


def _print_resharded(per_rank: List[dict], dp: int) -> None:
    mib = 2**20
    print(f"\nresume of a zero=0 dp={dp} checkpoint, per rank (MiB): share = the state it owns; "
          "format 3 verified every file it touches in full")
    print(f"{'layout':>22} {'rank':>4} {'share':>8} {'read':>8} {'verified (4-5)':>15} "
          f"{'whole files (3)':>16} {'load s':>7}")
    for name, label in (("zero1", f"zero=1 dp={dp}"), ("tp2_zero1", f"tp=2 zero=1 dp={dp // 2}")):
        for r, res in enumerate(per_rank):
            x = res[name]
            print(f"{label:>22} {r:>4} {x['share'] / mib:>8.1f} {x['read'] / mib:>8.1f} "
                  f"{x['verified'] / mib:>15.1f} {x['whole_files'] / mib:>16.1f} "
                  f"{x['load_s']:>7.2f}")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
