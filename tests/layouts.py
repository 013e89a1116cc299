"""Train the same steps under any (tp, pp, dp, zero, sp) and compare with the serial run.

`train_layout(...)` runs `steps` optimizer steps on real gloo ranks (fp32, dropout 0) and
returns, per rank: the step losses, grad norms, the validation loss, the MoE figures of every
step (`Trainer.last_moe`) and the routers' selection biases after it, and after every step this
rank's slice of every parameter (for zero 3, gathered from the shards first) and the most host
bytes offloaded activations held (offload.activations); with eval.hellaswag, the scores of the
initial weights. `assert_equal`
checks gradient integrity (losses and norms equal the serial run's within `rel`) and state
consistency (every rank's parameters, at every step, are its slice of the serial parameters; so
DP replicas are identical to each other).
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalite.cli.fault_exit import fit_or_exit
from megalite.config.layout import validate
from megalite.config.schema import Config, load_config
from megalite.model.moe.step import RouterBiases
from megalite.parallel.param_spec import ParamSpec
from megalite.testing.collective_order import OrderProbe
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.conftest import TINY

# optim.eps=1e-6: the attention's key bias has an exactly zero gradient (softmax is shift
# invariant), so what reaches AdamW there is rounding noise, which eps=1e-8 amplifies into
# updates of ~1e-6 that differ between layouts (their sums round differently); 1e-6 keeps the
# noise below the comparison's tolerance without touching any real gradient of these models.
# log.peak_tflops: MFU's peak as given, instead of a CPU matmul measurement (~1 s of CPU in
# every trainer built; tests/integration/cli/test_pretrain.py covers the measured peak).
FP32_NO_DROPOUT = ["precision=fp32", "model.resid_pdrop=0", "model.embd_pdrop=0",
                   "model.attn_pdrop=0", "log.every=1", "log.wandb=false", "train.eval_every=0",
                   "optim.eps=1e-6", "log.peak_tflops=1"]


@dataclass
class Prepared:
    """A run whose trainer `prepare(trainer)` changes before its first step (e.g. the
    routers' biases); what the callable `prepare` returns is called after the steps, its
    value the result's "extra". `run`: overrides, or the configuration made of them."""

    run: object
    prepare: Callable


@dataclass
class Later:
    """A run that reads what an earlier run of the same launch writes (its checkpoint.resume):
    its overrides composed in the ranks as it starts, and `steps` steps of its own."""

    run: List[str]
    steps: int


def _steps(rank, world, run, run_dir, steps, save_at=None, probe=False):
    """`run`: overrides, or the configuration `composed` made of them in the caller, or
    either `Prepared`; `probe`: the rank's collective launches recorded (`launched`, for
    `order_mismatches`)."""
    prepare = None
    if isinstance(run, Prepared):
        run, prepare = run.run, run.prepare
    cfg = run if isinstance(run, Config) else composed(run)
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    order = OrderProbe.install(trainer.topo.counter) if probe else None
    collect = None if prepare is None else prepare(trainer)
    hellaswag = None if trainer.hellaswag is None else trainer.evaluate_hellaswag()  # step 0
    zero3 = trainer.engine.zero3
    losses, norms, params, in_flight, param_norms, masters_cast = [], [], [], [], [], []
    moe = []  # MoE runs: each step's routing figures (trainer.last_moe; None without MoE)
    biases = RouterBiases.of(trainer.model.chunks)  # MoE with a bias: after each step
    moe_bias = []
    masters = [_masters(trainer.engine)]
    counter = trainer.topo.counter
    offload, offload_peaks = trainer.model.activation_offload, []
    for _ in range(steps):
        before = counter.snapshot()
        loss, norm = trainer.train_step()
        # overlap_param_gather: the next forward would wait (and, with offload.optimizer,
        # launch the gathers of the buckets still stepping: counted with the step's bytes)
        trainer.engine.wait_for_params()
        step_comm = counter.delta(counter.snapshot(), before)
        offload_peaks.append(None if offload is None else offload.take_peak())
        in_flight.append(trainer.schedule.peak_in_flight)
        if save_at is not None and trainer.step == save_at:
            trainer.save()
        losses.append(None if loss is None else trainer._global_mean(loss))  # None: skipped
        norms.append(norm)
        moe.append(trainer.last_moe)
        moe_bias.append(None if biases is None else biases.state_dict())
        param_norms.append(trainer.engine.param_norm().item())
        masters_cast.append(_parameters_are_masters_cast(trainer.engine))
        ctx = gathered_parameters(zero3) if zero3 is not None else contextlib.nullcontext()
        with ctx:
            params.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    val = trainer.evaluate()
    specs = dict(trainer.model.param_specs)
    c = trainer.topo.coords
    local_numel = sum(p.numel() for p in trainer.model.parameters())
    return {"losses": losses, "norms": norms, "param_norms": param_norms, "val": val,
            "moe": moe, "moe_bias": moe_bias, "extra": None if collect is None else collect(),
            "ep_rank": trainer.topo.ep_rank, "ep": trainer.topo.ep_size,
            "hellaswag": hellaswag,
            "params": params, "specs": specs,
            "coords": (c.tp_rank, c.pp_rank, c.dp_rank), "tp_rank": c.tp_rank, "tp": trainer.topo.tp_size,
            "in_flight": in_flight, "local_numel": local_numel,
            "bytes": trainer.engine.state_bytes(), "step_comm": step_comm,
            "grad_staging": trainer.engine.grad_staging_bytes(),
            "reductions_in_flight": trainer.engine.peak_in_flight,
            "masters_cast": masters_cast, "masters": masters + [_masters(trainer.engine)],
            "offload_peaks": offload_peaks, "host_bytes": trainer.engine.host_state_bytes(),
            "launched": None if order is None else order.launched}


@contextlib.contextmanager
def gathered_parameters(zero3):
    """Every ZeRO-3 unit gathered while the context lasts (to read full parameters)."""
    for unit in zero3.state.values():
        zero3._ensure(unit)
    try:
        yield
    finally:
        zero3.end_of_step()


def _masters(engine) -> List[tuple]:
    """This rank's fp32 master ranges: (global name, lo, hi of the flattened TP slice, values)."""
    return [(seg.spec.name, seg.param_lo, seg.param_hi, piece.detach().clone())
            for piece, seg, _ in engine.main_params]


def _parameters_are_masters_cast(engine) -> bool:
    """Every owned range of the model-dtype parameters is its fp32 master range cast down
    (offload.optimizer: the device's part and the host's)."""
    for b in engine.buckets:
        host = None if engine.offload is None else engine.offload.range_of(b)
        parts = [(b.main, 0)] + ([] if host is None else [(host.main, host.offset)])
        for main, at in parts:
            region = b.param_region[at:at + main.numel()]
            if main.dtype != torch.float32 or not torch.equal(region, main.to(region.dtype)):
                return False
    return True


def _many(rank, world, runs, run_dir, steps, save_at, probe=False):
    return [_steps(rank, world, run.run, f"{run_dir}/{i}", run.steps, save_at, probe)
            if isinstance(run, Later) else
            _steps(rank, world, run, f"{run_dir}/{i}", steps, save_at, probe)
            for i, run in enumerate(runs)]


def fit_to_exit(trainer, run_dir) -> Tuple[Optional[int], Optional[dict]]:
    """Train through the CLI's fit_or_exit: its exit code (None: finished) and the run's
    resilience/fault.json (None: none written)."""
    try:
        fit_or_exit(trainer)
        code = None
    except SystemExit as e:
        code = e.code
    fault = Path(run_dir) / "resilience" / "fault.json"
    return code, json.loads(fault.read_text()) if fault.exists() else None


def composed(overrides: List[str]) -> Config:
    return load_config(TINY + FP32_NO_DROPOUT + overrides)


def train_in_process(run_dir, overrides, steps: int = 10,
                     save_at: Optional[int] = None) -> dict:
    """One configuration on one rank in this process (no spawn: a serial reference); with
    `save_at=k` a checkpoint after step k (to its `checkpoint.dir`)."""
    return _steps(0, 1, overrides, str(run_dir), steps, save_at)


def train_layout(tmp_path, world: int, overrides: List[str], steps: int = 10,
                 timeout_s: float = 600, save_at: Optional[int] = None) -> List[dict]:
    """One configuration on `world` ranks: a result per rank."""
    return train_layouts(tmp_path, world, [overrides], steps, timeout_s, save_at)[0]


def train_layouts(tmp_path, world: int, runs: List[object], steps: int = 10,
                  timeout_s: float = 900, save_at: Optional[int] = None,
                  probe: bool = False) -> List[List[dict]]:
    """Several configurations one after the other in the same `world` ranks (one launch):
    a list of per-rank results for each configuration. With `save_at=k` each run writes a
    checkpoint after its step k (to its `checkpoint.dir`); with `probe` each result holds
    the rank's collective launches (`launched`, under the order probe). Each configuration is composed
    here, once, rather than on every rank (Hydra takes about 0.5 s of CPU a composition), but
    a `Later` one (resuming an earlier run's checkpoint, which does not exist yet)."""
    configs = [Prepared(composed(run.run), run.prepare) if isinstance(run, Prepared)
               else run if isinstance(run, Later) else composed(run) for run in runs]
    per_rank = run_ranks(_many, world, args=(configs, str(tmp_path), steps, save_at, probe),
                         timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]


PER_STEP = ("losses", "norms", "param_norms", "params")


def from_step(result: dict, start: int) -> dict:
    """A run's result seen from step `start` on (to compare a resumed run with)."""
    return {**result, **{key: result[key][start:] for key in PER_STEP}}


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def serial_global(serial: dict, step: int) -> Dict[str, torch.Tensor]:
    """Serial parameters at `step` under their global names (vocabulary padding removed)."""
    return {serial["specs"][n].name: serial["specs"][n].unshard([t])
            for n, t in serial["params"][step].items()}


def assert_equal(serial: dict, ranks: List[dict], rel: float = 1e-5, atol: float = 1e-6) -> None:
    steps = len(serial["losses"])
    for r, res in enumerate(ranks):
        assert len(res["losses"]) == steps
        for s in range(steps):
            assert close(serial["losses"][s], res["losses"][s], rel), \
                (r, s, serial["losses"][s], res["losses"][s])
            assert close(serial["norms"][s], res["norms"][s], rel), \
                (r, s, serial["norms"][s], res["norms"][s])
            assert close(serial["param_norms"][s], res["param_norms"][s], rel), \
                (r, s, serial["param_norms"][s], res["param_norms"][s])
        assert close(serial["val"], res["val"], rel), (r, serial["val"], res["val"])
        for s in range(steps):
            ref = serial_global(serial, s)
            for name, local in res["params"][s].items():
                spec: ParamSpec = res["specs"][name]
                expect = spec.shard(ref[spec.name], res["tp_rank"], res["tp"],
                                    res.get("ep_rank", 0), res.get("ep", 1))
                torch.testing.assert_close(local, expect, rtol=rel, atol=atol,
                                           msg=f"rank {r} step {s} {name}")


def _global_masters(result: dict, which: int) -> Dict[str, torch.Tensor]:
    """A serial run's fp32 master weights (first or last of `result["masters"]`) as global
    tensors (vocabulary padding removed)."""
    flat: Dict[str, list] = {}
    for name, lo, _, values in result["masters"][which]:
        flat.setdefault(name, []).append((lo, values))
    specs = {s.name: s for s in result["specs"].values() if not s.tied_copy}
    return {name: specs[name].unshard([torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])])
                                       .view(specs[name].local_shape(1))])
            for name, parts in flat.items()}


def master_update_error(serial: dict, rank: dict) -> float:
    """How far a rank's fp32 master weights after the run are from its slice of the serial
    run's, relative to how far training moved them: ||w - w_serial|| / ||w_serial - w_0||
    over the ranges the rank owns. Under bf16/fp16 the two runs round differently, so this
    is small but not zero; a lost or doubled gradient or update makes it of order 1."""
    start, end = _global_masters(serial, 0), _global_masters(serial, -1)
    specs = {s.name: s for s in rank["specs"].values()}
    err = moved = 0.0
    for name, lo, hi, values in rank["masters"][-1]:
        spec = specs[name]
        where = rank["tp_rank"], rank["tp"], rank.get("ep_rank", 0), rank.get("ep", 1)
        expect = spec.shard(end[name], *where).reshape(-1)[lo:hi]
        initial = spec.shard(start[name], *where).reshape(-1)[lo:hi]
        err += float(((values - expect) ** 2).sum())
        moved += float(((expect - initial) ** 2).sum())
    return math.sqrt(err / moved)
