"""The resilience services of a run (`resilience.*`; each None when off): the replica check,
the straggler report, the hang watch, the fault drill and the rerun attribution. The
collectives' observers they read (the straggler waits, the hang dumps' flight recorder) come
with the topology (`megalite.train.runtime.init_runtime`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megalite.config.inject import parse_inject
from megalite.config.schema import Config
from megalite.model.stage import PipelineStage
from megalite.parallel.rng import RNGTracker
from megalite.parallel.zero import ZeroEngine
from megalite.resilience.deterministic import use_deterministic_kernels
from megalite.resilience.hang import HangWatch
from megalite.resilience.hang_store import default_store
from megalite.resilience.inject import FaultInjector
from megalite.resilience.nccl_flight import set_nccl_flight_env
from megalite.resilience.replicas import ReplicaCheck
from megalite.resilience.rerun import RerunAttribution
from megalite.resilience.stragglers import StragglerReport
from megalite.train.loss_scale import LossScaler
from megalite.train.runtime import Runtime
from megalite.utils import log


@dataclass(frozen=True)
class ResilienceServices:
    replicas: Optional[ReplicaCheck] = None  # resilience.check_every
    stragglers: Optional[StragglerReport] = None  # resilience.straggler_report_every
    hang_watch: Optional[contextlib.AbstractContextManager] = None  # resilience.hang_dump
    injector: Optional[FaultInjector] = None  # resilience.inject's drill
    rerun: Optional[RerunAttribution] = None  # resilience.rerun


def build_resilience(cfg: Config, rt: Runtime, run_dir: Path, model: PipelineStage,
                     engine: ZeroEngine, rng: RNGTracker,
                     loss_scaler: Optional[LossScaler]) -> ResilienceServices:
    """The services `cfg.resilience` turns on, for `rt`'s topology (made by
    `init_runtime(cfg)`: its counter carries the observers they need). Collective (the
    straggler report gathers where every rank runs)."""
    res, topo = cfg.resilience, rt.topology
    _check_observers(cfg, rt)
    replicas = ReplicaCheck(engine, topo, rt.device, res.check_every,
                            rt.layout.sequence_parallel, res.tp_rtol) \
        if res.check_every else None
    stragglers = StragglerReport(topo, rt.device, res.straggler_report_every,
                                 res.straggler_factor, res.straggler_min_s) \
        if res.straggler_report_every else None
    hang_watch = None
    if topo.counter.flight is not None:  # every group's collectives recorded; dumps in `fit`
        if rt.device.type == "cuda":  # PyTorch's NCCL flight recorder dumps to hang/nccl/
            set_nccl_flight_env(run_dir)
        hang_watch = HangWatch(topo.counter.flight, run_dir, topo.rank, topo.world_size,
                               res.hang_wait_s, res.hang_signal, default_store())
    # before the rerun: its gradient listener goes first
    probe = model.family.probe_tensor
    injector = FaultInjector(parse_inject(res.inject, probe), model, engine, topo.rank) \
        if res.inject is not None else None
    rerun = None
    if res.rerun != "off":
        if res.rerun_deterministic and use_deterministic_kernels(rt.device) and topo.rank == 0:
            log.get_logger().info("resilience.rerun: torch's deterministic "
                                  "algorithms on (resilience.rerun_deterministic=true)")
        rerun = RerunAttribution(res, topo, rt.device, engine, rng, run_dir, loss_scaler)
    return ResilienceServices(replicas, stragglers, hang_watch, injector, rerun)


def _check_observers(cfg: Config, rt: Runtime) -> None:
    """The topology observes its collectives as `cfg.resilience` asks (a runtime made by
    `init_runtime` of another configuration would silently time or record nothing)."""
    res, counter = cfg.resilience, rt.topology.counter
    for key, on, observer in (("straggler_report_every", bool(res.straggler_report_every),
                               counter.waits),
                              ("hang_dump", bool(res.hang_dump), counter.flight)):
        if on != (observer is not None):
            raise ValueError(f"resilience.{key}={getattr(res, key)!r} but the runtime's "
                             f"topology was made {'without' if on else 'with'} its observer: "
                             "make the runtime with init_runtime(cfg) of this configuration")
