"""`layout=auto`: the planner's fastest predicted layout for the world size a run is launched
with, as a pure function of (configuration, world size, device profile, ranks per node, the
layout keys given explicitly) — never of a measurement taken at launch, so every rank and every
restart picks the same one. The layout keys given on the command line are held fixed and the
search covers the rest."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from megalite.config.errors import fail
from megalite.config.layout import GpuInfo
from megalite.config.schema import Config
from megalite.plan.devices import (
    DeviceProfile,
    device_profile,
    load_profile_file,
    table_entry_for,
)
from megalite.plan.report import explicit_layout_keys, ranking_table
from megalite.plan.search import NothingFits, search


@dataclass
class AutoLayout:
    overrides: list  # the chosen layout as command-line overrides
    fixed: Dict[str, object]  # held fixed (given explicitly)
    profile: str
    gpus_per_node: int
    prediction: dict  # Prediction.as_dict()
    peak_bytes: float  # the plan's peak per rank
    why: str  # the ranking the choice came from

    def record(self) -> dict:
        """For the metrics header."""
        return {"layout": "auto", "chosen": self.overrides, "held_fixed": self.fixed,
                "profile": self.profile, "gpus_per_node": self.gpus_per_node,
                "planned_peak_bytes": self.peak_bytes, "prediction": self.prediction}


def run_profile(cfg: Config, gpu: Optional[GpuInfo], memory_bytes: Optional[int] = None
                ) -> DeviceProfile:
    """planner.profile, else planner.device, else the detected GPU's table entry (cpu without
    a GPU). ConfigError naming the key when none is known."""
    p = cfg.planner
    if p.profile is not None:
        try:
            return load_profile_file(p.profile)
        except ValueError as e:
            fail("planner.profile", p.profile, str(e))
    if p.device != "auto":
        try:
            return device_profile(p.device)
        except ValueError as e:
            fail("planner.device", p.device, str(e))
    if gpu is None or cfg.device == "cpu":
        return device_profile("cpu")
    entry = table_entry_for(gpu.name, memory_bytes)
    if entry is None:
        fail("planner.device", "auto", f"the detected GPU {gpu.name!r} is not in the device "
             "table; name a similar one (planner.device=a100-80gb, ...) or calibrate one "
             "(scripts/plan.py --calibrate, then planner.profile=FILE)")
    return entry


def resolve_layout(cfg: Config, world: int, profile: DeviceProfile, gpus_per_node: int,
                   fixed: Dict[str, object]) -> Tuple[Config, AutoLayout]:
    """The configuration with the chosen layout and what to record about the choice;
    ConfigError naming `layout` (and the keys held fixed) when no layout fits."""
    try:
        result = search(cfg, world, profile, gpus_per_node, top=3, fixed=fixed)
    except NothingFits as e:
        held = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing held fixed"
        fail("layout", "auto", f"({held}) {e}")
    best = result.best[0]
    chosen = replace(best.config, layout="auto")
    why = ranking_table(result, profile, world, gpus_per_node, fixed)
    return chosen, AutoLayout(best.choice.overrides(), fixed, profile.name, gpus_per_node,
                              best.prediction.as_dict(), best.peak_bytes, why)


def launch_layout(cfg: Config, world: int, gpu: Optional[GpuInfo], local_ranks: int,
                  overrides) -> Tuple[Config, AutoLayout]:
    """`resolve_layout` for a launch: the run's profile (`run_profile`, with the detected
    GPU's memory), planner.gpus_per_node or the ranks started on this node, and the layout
    keys `overrides` (the command line) give explicitly."""
    memory = None
    if gpu is not None:
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
    profile = run_profile(cfg, gpu, memory)
    per_node = cfg.planner.gpus_per_node or local_ranks
    return resolve_layout(cfg, world, profile, per_node,
                          explicit_layout_keys(list(overrides), cfg))
