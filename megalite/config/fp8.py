"""The `fp8` section (FP8 matmuls in the transformer blocks' linears, `megalite.parallel.fp8`)
and its rules before launch: the device has FP8 matmuls (a GPU of compute capability 8.9 or
above, or a CPU with `fp8.emulate=true`), and every dimension of the FP8 products is a
multiple of 16 (`torch._scaled_mm`'s rule on CUDA, kept on a CPU too so that what passes
here runs on a GPU)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megalite.config.errors import fail

RECIPES = ("none", "tensorwise", "rowwise")
FP8_CAPABILITY = (8, 9)  # Ada (L4, L40S, RTX 4090) and Hopper (H100, H200) on
DIM_MULTIPLE = 16


@dataclass
class Fp8Config:
    recipe: str = "none"  # none | tensorwise (one scale per tensor, gradients in e5m2) |
    #                       rowwise (one scale per row, gradients in e4m3); docs/fp8.md
    emulate: bool = False  # allow FP8 on a CPU: torch._scaled_mm's CPU kernel (slow; for
    #                        tests and for checking a configuration without a GPU)

    def check(self) -> None:
        if self.recipe not in RECIPES:
            fail("fp8.recipe", self.recipe, f"use one of {', '.join(RECIPES)}")


def fp8_linears(n_embd: int, ffn: int, tp: int, arch: str = "gpt2"
                ) -> List[Tuple[str, str, int, str, int]]:
    """(layer, key of its input dimension, local input size, key of its output dimension,
    local output size) of each FP8 linear of a block of `arch` (model.arch): one TP rank's
    weight. Llama's q/k/v projections are not FP8 linears (megalite.model.llama.Projection)."""
    if arch == "llama":
        return [("model.layers.*.self_attn.o_proj", "model.n_embd / tp", n_embd // tp,
                 "model.n_embd", n_embd),
                ("model.layers.*.mlp.gate_up_proj", "model.n_embd", n_embd,
                 "2 * model.n_inner / tp", 2 * ffn // tp),
                ("model.layers.*.mlp.down_proj", "model.n_inner / tp", ffn // tp,
                 "model.n_embd", n_embd)]
    return [("transformer.h.*.attn.c_attn", "model.n_embd", n_embd,
             "3 * model.n_embd / tp", 3 * n_embd // tp),
            ("transformer.h.*.attn.c_proj", "model.n_embd / tp", n_embd // tp,
             "model.n_embd", n_embd),
            ("transformer.h.*.mlp.c_fc", "model.n_embd", n_embd, "model.n_inner / tp", ffn // tp),
            ("transformer.h.*.mlp.c_proj", "model.n_inner / tp", ffn // tp, "model.n_embd", n_embd)]


def check_fp8(cfg, device_type: str, gpu_name: Optional[str],
              capability: Optional[Tuple[int, int]]) -> List[str]:
    """The FP8 rules of `cfg` (a `Config`) on `device_type`; `gpu_name`, `capability`: the
    node's GPU (None: not known). Raises ConfigError; returns the warnings."""
    recipe = cfg.fp8.recipe
    if recipe == "none":
        return []
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


def _check_dims(cfg) -> None:
    """Every local dimension of the three products of each FP8 linear: its weight's input and
    output sizes, and the tokens of a micro-batch (the weight gradient's contraction)."""
    m, t = cfg.model, cfg.train
    recipe = cfg.fp8.recipe
    remedy = (f"FP8 matmuls (torch._scaled_mm) need every dimension to be a multiple of "
              f"{DIM_MULTIPLE}; change it, or use fp8.recipe=none")
    for layer, in_key, in_size, out_key, out_size in fp8_linears(m.n_embd, m.ffn_size, cfg.tp, m.arch):
        for key, size in ((in_key, in_size), (out_key, out_size)):
            if size % DIM_MULTIPLE:
                fail("fp8.recipe", recipe, f"{layer}: {key} = {size} (tp={cfg.tp}, one rank's "
                     f"weight) is not a multiple of {DIM_MULTIPLE}; {remedy}")
    tokens = t.seq_len * t.micro_batch_size
    if tokens % DIM_MULTIPLE:
        fail("fp8.recipe", recipe, f"every FP8 linear's weight gradient: tokens per micro-"
             f"batch train.seq_len * train.micro_batch_size = {t.seq_len} * "
             f"{t.micro_batch_size} = {tokens} is not a multiple of {DIM_MULTIPLE}; {remedy}")
