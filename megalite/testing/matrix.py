"""Run rows of the combination matrix (`megalite.config.combinations`) on spawned gloo ranks and
hold each against its serial run.

A row is trained the way `pretrain.py` trains: validated, planned and built by the launch path
(`megalite.train.launch`), trained by `fit()` for SAVED steps (ending in a checkpoint), then
built again and resumed from that checkpoint to step STEPS. Its serial run
(`combinations.serial_row`: the same family, head, precision, FP8 recipe and batch schedule on
one rank, no offload or recompute) trains the STEPS steps without a break. The row must equal
it on every step's loss and gradient norm and on the final fp32 master weights (the parameters
are these cast to the compute dtype), within the tolerance of its precision and FP8 recipe
(`TOLERANCES`). A row with the document mask must also have read windows where the mask acts:
a document boundary in every window and, at cp 2, a document crossing the cut between the CP
ranks' chunks (`megalite.testing.documents`; the matrix trains on its short documents). Rows
share spawns: one spawned world per world size runs all its rows in sequence, and the serial
runs are made once each, in one world of one rank.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from megalite.config.combinations import Row, labels, row_config, serial_row, world_size
from megalite.config.schema import Config
from megalite.data.loader import read_windows
from megalite.testing.collective_order import OrderProbe, order_mismatches
from megalite.testing.documents import document_failures
from megalite.testing.spawn import run_ranks
from megalite.train.launch import launch
from megalite.train.selftest import release

SAVED, STEPS = 2, 3  # the checkpoint a row resumes from, and its steps in all


@dataclass(frozen=True)
class Tolerance:
    """Relative tolerances of the losses and grad norms, and of the final master weights:
    `rtol` elementwise (with an absolute floor of 1e-5: AdamW's first steps move a weight by
    about lr = 1e-3 whatever its gradient, so a gradient near zero that rounds differently
    moves it differently), 0 = not checked, and `update` on ||w - w_serial|| / ||w_serial -
    w_0|| (a lost or doubled gradient or update makes that of order 1)."""

    loss: float
    norm: float
    rtol: float = 0.0
    update: float = 0.0


# fp32: summation order alone (the parity tests' 1e-5); bf16: tests/integration/
# test_mixed_precision.py's bounds; FP8: tests/integration/test_fp8.py's later steps' for
# losses and norms (fp32) and bf16's (bf16). Measured on the matrix's model at tp=2 (3 steps;
# loss, norm, update error at worst): FP8 fp32 1.5e-4, 1.4e-2, 0.112 (Llama, tensorwise, the
# same with or without dp, pp, offload, recompute: FP8's rounding under TP); FP8 bf16 2.8e-4,
# 1.3e-2, 0.13
TOLERANCES = {("fp32", False): Tolerance(loss=1e-5, norm=1e-5, rtol=1e-5, update=1e-3),
              ("bf16", False): Tolerance(loss=3e-3, norm=5e-2, update=0.25),
              ("fp32", True): Tolerance(loss=1e-3, norm=3e-2, update=0.2),
              ("bf16", True): Tolerance(loss=3e-3, norm=5e-2, update=0.25)}


# MoE under bf16 or FP8: a rounding difference can flip a token's expert choice (a discrete
# decision), which moves the experts' updates by that token's whole share; the update bound is
# doubled (measured 0.261 on cp 2 + pp 2 ZB-V + ZeRO 3 + recompute + FP8 in bf16 with ramp-up,
# losses and norms within the dense bounds). fp32 MoE rows keep the tight tolerance.
MOE_LOW_PRECISION_UPDATE = 0.5


def tolerance_of(row: Sequence[int]) -> Tolerance:
    v = labels(row)
    tol = TOLERANCES[v["precision"], v["fp8"] != "none"]
    if v["family"] == "mixtral moe" and tol.update and tol.rtol == 0.0:
        return dataclasses.replace(tol, update=MOE_LOW_PRECISION_UPDATE)
    return tol


def _parts(base: Config, row: Sequence[int], run_dir: str, resume: bool) -> List[Config]:
    """The row's configurations: [until SAVED, resumed until STEPS], or [STEPS at once]."""
    cfg = row_config(base, row)
    cfg.checkpoint.dir = f"{run_dir}/checkpoints"
    if not resume:
        cfg.train.max_steps = STEPS
        return [cfg]
    first, resumed = copy.deepcopy(cfg), copy.deepcopy(cfg)
    first.train.max_steps, resumed.train.max_steps = SAVED, STEPS
    resumed.checkpoint.resume = "auto"
    return [first, resumed]


def _masters(engine) -> List[tuple]:
    """This rank's fp32 master ranges: (global name, lo, hi of the flattened TP slice, values)."""
    return [(seg.spec.name, seg.param_lo, seg.param_hi, piece.detach().clone())
            for piece, seg, _ in engine.main_params]


def _reading(trainer, windows: List[np.ndarray]):
    """`fit`'s hook around each step: the step, then the token windows [k, seq_len + 1] it
    read on this rank appended to `windows`."""
    def around(step):
        out = step()
        batches = trainer.batches
        datasets, starts = zip(*batches.last_samples)
        windows.append(read_windows(batches.sources, np.array(datasets), np.array(starts),
                                    batches.seq_len))
        return out
    return around


def _train(world: int, parts: List[Config], run_dir: str) -> dict:
    records, first_masters, choices, windows, launched = [], None, None, [], []
    for cfg in parts:
        run = launch(cfg, world, run_dir)  # validate -> plan -> runtime -> build, as pretrain.py
        runtime, trainer = run.runtime, run.trainer
        probe = OrderProbe.install(trainer.topo.counter)  # the ranks' collective order
        if first_masters is None:
            first_masters = _masters(trainer.engine)
            if trainer.hellaswag is not None:  # eval.hellaswag: every ending's loss, step 0
                choices = trainer.evaluate_hellaswag().losses
        records += trainer.fit(around_step=_reading(trainer, windows))
        launched += probe.launched
        release(runtime)  # a process trains many runs: its groups' sockets would pile up
    c = trainer.topo.coords
    return {"steps": [r["step"] for r in records], "losses": [r["loss"] for r in records],
            "norms": [r["grad_norm"] for r in records],
            "val_losses": [r["val_loss"] for r in records], "choice_losses": choices, "first": first_masters,
            "last": _masters(trainer.engine), "tp_rank": c.tp_rank, "tp": trainer.topo.tp_size,
            "ep_rank": trainer.topo.ep_rank, "ep": trainer.topo.ep_size,
            "specs": {s.name: s for s in trainer.model.param_specs.values()},
            "windows": np.concatenate(windows), "launched": launched,
            "eos_id": trainer.batches.sources[0].meta.get("eos_token_id")}


def _rows_on_ranks(rank: int, world: int, jobs: List[Tuple[List[Config], str]]) -> List[dict]:
    return [_train(world, parts, run_dir) for parts, run_dir in jobs]


def serial_runs(base: Config, rows: Sequence[Row], workdir: Path,
                timeout_s: float = 900) -> Dict[Row, dict]:
    """The serial run of every row's `serial_row`, each once, in one spawned rank."""
    keys = sorted({serial_row(r) for r in rows})
    jobs = [(_parts(base, k, f"{workdir}/serial{i}", resume=False), f"{workdir}/serial{i}")
            for i, k in enumerate(keys)]
    (results,) = run_ranks(_rows_on_ranks, 1, args=(jobs,), timeout_s=timeout_s)
    return dict(zip(keys, results))


def _config_jobs(configs: Sequence[Config], world: int, workdir: Path, steps: int
                 ) -> List[Tuple[List[Config], str]]:
    """Each configuration trained `steps` steps without a break, in its own run directory."""
    jobs = []
    for i, cfg in enumerate(configs):
        cfg = copy.deepcopy(cfg)
        cfg.train.max_steps, cfg.checkpoint.dir = steps, f"{workdir}/c{world}r{i}/checkpoints"
        jobs.append(([cfg], f"{workdir}/c{world}r{i}"))
    return jobs


def run_configs(configs: Sequence[Config], world: int, workdir: Path, steps: int = STEPS,
                timeout_s: float = 900) -> List[List[dict]]:
    """Runs that are no rows of the matrix (e.g. axes it does not have yet), each trained
    `steps` steps without a break, in one spawned world of `world` ranks: per run, a result
    per rank (`check_ranks` holds them against a serial run's)."""
    jobs = _config_jobs(configs, world, workdir, steps)
    per_rank = run_ranks(_rows_on_ranks, world, args=(jobs,), timeout_s=timeout_s)
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(configs))]


def run_rows(base: Config, rows: Sequence[Row], workdir: Path,
             timeout_s: float = 900, configs: Sequence[Config] = ()) -> List[List[dict]]:
    """Rows of one world size in one spawned world: per row, a result per rank; then, in the
    same spawn, per run of `configs` (of the same world size, as `run_configs` trains them)."""
    (world,) = {world_size(r) for r in rows}
    jobs = [(_parts(base, r, f"{workdir}/w{world}r{i}", resume=True), f"{workdir}/w{world}r{i}")
            for i, r in enumerate(rows)] + _config_jobs(configs, world, workdir, STEPS)
    per_rank = run_ranks(_rows_on_ranks, world, args=(jobs,), timeout_s=timeout_s)
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(jobs))]


def _global(result: dict, which: str) -> Dict[str, torch.Tensor]:
    """A one-rank run's master weights as global tensors (vocabulary padding removed)."""
    flat: Dict[str, list] = {}
    for name, lo, _, values in result[which]:
        flat.setdefault(name, []).append((lo, values))
    specs = result["specs"]
    return {name: specs[name].unshard([torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])])
                                       .view(specs[name].local_shape(1))])
            for name, parts in flat.items()}


def _master_failures(serial: dict, rank: dict, tol: Tolerance) -> List[str]:
    start, end = _global(serial, "first"), _global(serial, "last")
    err = moved = 0.0
    failures = []
    for name, lo, hi, values in rank["last"]:
        spec = rank["specs"][name]
        where = rank["tp_rank"], rank["tp"], rank["ep_rank"], rank["ep"]  # EP: its experts
        expect = spec.shard(end[name], *where).reshape(-1)[lo:hi]
        initial = spec.shard(start[name], *where).reshape(-1)[lo:hi]
        err += float(((values - expect) ** 2).sum())
        moved += float(((expect - initial) ** 2).sum())
        if tol.rtol and not torch.allclose(values, expect, rtol=tol.rtol, atol=1e-5):
            worst = float((values - expect).abs().max())
            failures.append(f"{name}[{lo}:{hi}]: max |master - serial| = {worst:.3g}")
    if tol.update and math.sqrt(err / moved) > tol.update:
        failures.append(f"master update error {math.sqrt(err / moved):.3g} > {tol.update}")
    return failures


def check_row(row: Sequence[int], serial: dict, ranks: List[dict]) -> List[str]:
    """What of `ranks` (a row's result per rank) differs from `serial` beyond the row's
    tolerance, and, for a row with the document mask, what the windows it read lack for the
    mask to act (`megalite.testing.documents.document_failures`: boundaries in every window;
    at cp 2 a document crossing the cut between the CP ranks' chunks): an empty list when it
    equals its serial run and reads what it names."""
    failures = check_ranks(serial, ranks, tolerance_of(row))
    named = labels(row)
    if named["attention mask"] == "document":
        failures += document_failures(ranks, cp=int(named["cp"].split()[0]))
    return failures


def check_ranks(serial: dict, ranks: List[dict], tol: Tolerance, steps: int = STEPS
                ) -> List[str]:
    """What of `ranks` (a run's result per rank) differs from `serial` beyond `tol` on each
    of the `steps` steps' logged loss, grad norm and validation loss (where the run
    evaluates), on every HellaSwag ending's loss at step 0 (eval.hellaswag) and on the final
    master weights; and whether every two ranks launched their shared collectives in one
    order (NCCL's rule, `megalite.testing.collective_order`)."""
    failures = order_mismatches([res["launched"] for res in ranks])
    for r, res in enumerate(ranks):
        if res["steps"] != list(range(1, steps + 1)):
            failures.append(f"rank {r}: steps {res['steps']} (the resume did not continue)")
            continue
        for s in range(steps):
            for key, what, rel in (("losses", "loss", tol.loss), ("norms", "grad norm", tol.norm),
                                   ("val_losses", "validation loss", tol.loss)):
                a, b = serial[key][s], res[key][s]
                if a is None and b is None:  # no evaluation at this step
                    continue
                if a is None or b is None or not math.isclose(a, b, rel_tol=rel, abs_tol=1e-7):
                    failures.append(f"rank {r} step {s + 1} {what}: {b!r}, serial {a!r}")
        expect, got = serial.get("choice_losses"), res.get("choice_losses")
        if (expect is None) != (got is None) or (expect is not None and not torch.allclose(
                got, expect, rtol=tol.loss, atol=1e-5)):
            failures.append(f"rank {r}: HellaSwag ending losses {got}, serial {expect}")
        failures += [f"rank {r}: {f}" for f in _master_failures(serial, res, tol)]
    return failures


@dataclass
class MatrixReport:
    rows: List[Row]
    failures: Dict[int, List[str]]  # row index -> what differs (rows that equal serial: [])
    seconds: Dict[str, float]  # "serial", "world N": wall time of each spawn


def run_matrix(base: Config, rows: Sequence[Row], workdir: Path,
               timeout_s: float = 3600) -> MatrixReport:
    """Every row against its serial run: the serial runs, then one spawn per world size."""
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    serial = serial_runs(base, rows, workdir, timeout_s)
    seconds["serial"] = time.perf_counter() - start
    failures: Dict[int, List[str]] = {}
    for world in sorted({world_size(r) for r in rows}):
        index = [i for i, r in enumerate(rows) if world_size(r) == world]
        start = time.perf_counter()
        results = run_rows(base, [rows[i] for i in index], workdir, timeout_s)
        seconds[f"world {world}"] = time.perf_counter() - start
        for i, ranks in zip(index, results):
            failures[i] = check_row(rows[i], serial[serial_row(rows[i])], ranks)
    return MatrixReport(list(rows), failures, seconds)
