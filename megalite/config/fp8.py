"""The `fp8` section (FP8 matmuls in the transformer blocks' linears, `megalite.parallel.fp8`)
and its rules before launch: the device has FP8 matmuls (a GPU of compute capability 8.9 or
above, or a CPU with `fp8.emulate=true`), and every dimension of the FP8 products is a
multiple of 16 (`torch._scaled_mm`'s rule on CUDA, kept on a CPU too so that what passes
here runs on a GPU). `fp8_dims_refusal` is the one home of that rule: the launch refuses with
it, and the planner's search skips the layouts it refuses. `fp8.recipe=auto` asks layout=auto
to choose between none and tensorwise (`megalite.plan.auto`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megalite.config.errors import fail
from megalite.config.families import registered_family

RECIPES = ("none", "tensorwise", "rowwise", "auto")
FP8_CAPABILITY = (8, 9)  # Ada (L4, L40S, RTX 4090) and Hopper (H100, H200) on
DIM_MULTIPLE = 16


@dataclass
class Fp8Config:
    recipe: str = "none"  # none | tensorwise (one scale per tensor, gradients in e5m2) |
    #                       rowwise (one scale per row, gradients in e4m3) | auto (with
    #                       layout=auto: none or tensorwise, the faster predicted); docs/fp8.md
    emulate: bool = False  # allow FP8 on a CPU: torch._scaled_mm's CPU kernel (slow; for
    #                        tests and for checking a configuration without a GPU)

    def check(self) -> None:
        if self.recipe not in RECIPES:
            fail("fp8.recipe", self.recipe, f"use one of {', '.join(RECIPES)}")


def check_fp8(cfg, device_type: str, gpu_name: Optional[str],
              capability: Optional[Tuple[int, int]]) -> List[str]:
    """The FP8 rules of `cfg` (a `Config`) on `device_type`; `gpu_name`, `capability`: the
    node's GPU (None: not known). Raises ConfigError; returns the warnings."""
    recipe = cfg.fp8.recipe
    if recipe == "none":
        return []
    if recipe == "auto":  # layout=auto resolves it before validation (megalite.plan.auto)
        fail("fp8.recipe", recipe, "layout=auto chooses it (none or tensorwise, on a device "
             "whose profile has an FP8 matmul rate); set layout=auto, or name a recipe: none, "
             "tensorwise, rowwise")
    if device_type == "cpu" and not cfg.fp8.emulate:
        fail("fp8.emulate", False, f"fp8.recipe={recipe} on device cpu, which has no FP8 "
             "matmuls: set fp8.emulate=true to run them through torch._scaled_mm's CPU kernel "
             "(slow; for tests), or run on a GPU of compute capability >= 8.9 (H100, H200, "
             "L4, L40S, RTX 4090)")
    if device_type == "cuda" and capability is not None and tuple(capability) < FP8_CAPABILITY:
        fail("fp8.recipe", recipe, f"{gpu_name or 'this GPU'} (compute capability "
             f"{capability[0]}.{capability[1]}) has no FP8 matmuls: they need compute "
             "capability >= 8.9 (H100, H200, L4, L40S, RTX 4090); use fp8.recipe=none "
             "(bf16 matmuls)")
    _check_dims(cfg)
    if device_type == "cuda" and not cfg.train.compile:
        return [f"fp8.recipe={recipe} with train.compile=false: each FP8 product's amax, "
                "scale, cast and transpose run as separate kernels, which eat most of the "
                "FP8 matmuls' gain (the recipes' published speedups are with torch.compile); "
                "set train.compile=true"]
    return []


def fp8_dims_refusal(model, tp: int, seq_len: int, micro_batch: int) -> Optional[str]:
    """Why FP8 products cannot take the local dimensions of every FP8 linear of the model's
    family at `tp` (`FamilyRules.fp8_linears`: its
    weight's input and output sizes) and the tokens of a micro-batch (the weight gradient's
    contraction): the first dimension that is not a multiple of DIM_MULTIPLE, or None."""
    linears = registered_family(model.arch).fp8_linears(model, tp)
    for layer, in_key, in_size, out_key, out_size in linears:
        for key, size in ((in_key, in_size), (out_key, out_size)):
            if size % DIM_MULTIPLE:
                return (f"{layer}: {key} = {size} (tp={tp}, one rank's weight) is not a "
                        f"multiple of {DIM_MULTIPLE}")
    tokens = seq_len * micro_batch
    if tokens % DIM_MULTIPLE:
        return (f"every FP8 linear's weight gradient: tokens per micro-batch train.seq_len * "
                f"train.micro_batch_size = {seq_len} * {micro_batch} = {tokens} is not a "
                f"multiple of {DIM_MULTIPLE}")
    return None


def _check_dims(cfg) -> None:
    refusal = fp8_dims_refusal(cfg.model, cfg.tp, cfg.train.seq_len,
                               cfg.train.micro_batch_size)
    if refusal:
        fail("fp8.recipe", cfg.fp8.recipe, f"{refusal}; FP8 matmuls (torch._scaled_mm) need "
             f"every dimension to be a multiple of {DIM_MULTIPLE}; change it, or use "
             "fp8.recipe=none")
