"""`layout=auto`: the planner's fastest predicted layout for the world size a run is launched
with, as a pure function of (configuration, world size, device profile, ranks per node, the
layout keys given explicitly; under train.attention_mask=document also of the corpus at data.dir,
whose document lengths price the mask: `megalite.plan.document_terms.masked_work`, a fixed
sample of its windows) — never of a measurement taken at launch, so every rank and every
restart picks the same one. The layout keys given on the command line are held fixed and the
search covers the rest. With fp8.recipe=auto it also chooses the blocks' matmuls: the search
runs once in bf16 and once with tensorwise FP8 (the time model prices rowwise no faster: the
same casts, larger amax all-reduces) and the faster predicted fastest layout wins; a profile
without an FP8 matmul rate (no FP8 peak in the device table, a CPU) is refused."""
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
from megalite.plan.document_terms import masked_work
from megalite.plan.report import explicit_layout_keys, ranking_table
from megalite.plan.search import NothingFits, SearchResult, search

FP8_CHOICES = ("none", "tensorwise")  # what fp8.recipe=auto chooses between


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


def search_recipes(cfg: Config, world: int, profile: DeviceProfile, gpus_per_node: int,
                   top: int, fixed: Optional[Dict[str, object]] = None,
                   document_tokens: Optional[int] = None
                   ) -> Tuple[SearchResult, Dict[str, float]]:
    """`search`; with fp8.recipe=auto, the search of each of FP8_CHOICES whose fastest layout
    is predicted faster, and each one's predicted step seconds (empty otherwise; a recipe
    with no layout that fits is left out). ConfigError naming fp8.recipe when `profile` has
    no FP8 matmul rate; NothingFits when no recipe's layout fits. Under
    train.attention_mask=document every search prices the mask with the run's masked work,
    sampled once here (`masked_work`: documents of `document_tokens` tokens where given, else
    the corpus)."""
    work = masked_work(cfg, document_tokens)
    if cfg.fp8.recipe != "auto":
        return search(cfg, world, profile, gpus_per_node, top=top, fixed=fixed,
                      masked_work=work), {}
    if "fp8" not in profile.matmul_tflops:
        fail("fp8.recipe", "auto", f"the planner's device {profile.name} has no FP8 matmul "
             "rate (FP8 needs compute capability >= 8.9: H100, H200, L4, L40S, ...; a "
             "calibrated profile of such a GPU measures it): use fp8.recipe=none")
    results, refusal = {}, None
    for recipe in FP8_CHOICES:
        try:
            results[recipe] = search(replace(cfg, fp8=replace(cfg.fp8, recipe=recipe)), world,
                                     profile, gpus_per_node, top=top, fixed=fixed,
                                     masked_work=work)
        except NothingFits as e:
            refusal = e
    if not results:
        raise refusal
    times = {r: res.best[0].prediction.step_s for r, res in results.items()}
    return results[min(times, key=times.__getitem__)], times


def resolve_layout(cfg: Config, world: int, profile: DeviceProfile, gpus_per_node: int,
                   fixed: Dict[str, object]) -> Tuple[Config, AutoLayout]:
    """The configuration with the chosen layout (and, with fp8.recipe=auto, recipe) and what
    to record about the choice; ConfigError naming `layout` (and the keys held fixed) when no
    layout fits."""
    try:
        result, recipes = search_recipes(cfg, world, profile, gpus_per_node, 3, fixed)
    except NothingFits as e:
        held = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing held fixed"
        fail("layout", "auto", f"({held}) {e}")
    best = result.best[0]
    chosen = replace(best.config, layout="auto")
    why = ranking_table(result, profile, world, gpus_per_node, fixed)
    overrides = best.choice.overrides()
    if recipes:
        overrides.append(f"fp8.recipe={chosen.fp8.recipe}")
        why += "\nfp8.recipe=auto chose " + chosen.fp8.recipe + " (fastest layout predicted: " \
            + ", ".join(f"{r} {t * 1e3:.3g} ms" for r, t in recipes.items()) + " a step)"
    return chosen, AutoLayout(overrides, fixed, profile.name, gpus_per_node,
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
