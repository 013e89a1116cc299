"""The `resilience.inject` fault drill, parsed: which bit of which rank's tensor to flip, at
which step, and whether the fault is transient or persistent (`megalite.resilience.inject`
applies it; `megalite.resilience.inject_target` checks, before launch, that the rank holds the
tensor). Real API for drills, as Megatron's fault-injection flags are: it is refused unless
`resilience.allow_inject=true`, and at a step the run never reaches.

    resilience.inject=rank:1/step:3/target:param/kind:transient
    'resilience.inject="rank=1,step=3,target=param,kind=transient,index=0,bit=30"'

(items separated by `/` or `,`, keys from values by `:` or `=`; the first form needs no
quoting on a command line, the second is a quoted Hydra string.)

    rank    global rank whose device misbehaves (required)
    step    the optimizer step (1-based, as in metrics.jsonl) at which it does (required)
    target  param: its copy of the parameter reads wrong in the step's computation;
            grad: its local gradient of the parameter, before the data-parallel reduction
    kind    transient: only the step's first execution (a re-execution computes right);
            persistent: every computation this rank does at that step, re-executions and
            recomputations of another replica's micro-batches included
    tensor  the parameter's global name (default: the first block's first norm weight,
            transformer.h.0.ln_1.weight for GPT-2, model.layers.0.input_layernorm.weight for
            Llama: the model family's `probe_tensor`)
    index   the element of the parameter (flat, in this rank's shard; default 0)
    bit     the bit of the element's binary representation (default: the top exponent bit,
            30 of an fp32, 14 of a bf16 or fp16 parameter: 1.0 becomes inf); parameters are
            16-bit under precision bf16/fp16, the local gradients fp32

The parameter is flipped back after each computation, so the drill leaves the run's state as
it found it: what it exercises is the attribution of the step (`resilience.rerun`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megalite.config.errors import fail

KEY = "resilience.inject"
EXAMPLE = "e.g. rank:1/step:3/target:param/kind:transient"
TARGETS = ("param", "grad")
KINDS = ("transient", "persistent")


@dataclass(frozen=True)
class InjectSpec:
    rank: int
    step: int
    target: str = "param"
    kind: str = "transient"
    tensor: Optional[str] = None  # None: the family's default (`parse_inject`)
    index: int = 0
    bit: Optional[int] = None  # None: the top exponent bit of the element

    def bit_in(self, width: int) -> int:
        """The bit to flip in a `width`-bit element."""
        return width - 2 if self.bit is None else self.bit


def parse_inject(spec: str, default_tensor: Optional[str] = None) -> InjectSpec:
    """The drill `spec` names (ConfigError naming resilience.inject when malformed); a drill
    that names no tensor targets `default_tensor` (the model family's `probe_tensor`)."""
    fields = {}
    for item in re.split(r"[,/]", str(spec)):
        parts = re.split(r"[=:]", item, maxsplit=1)
        key, value = parts[0].strip(), parts[-1]
        if len(parts) < 2 or key not in InjectSpec.__dataclass_fields__:
            fail(KEY, spec, f"{item.strip()!r} is not key:value (or key=value) with a key among "
                 f"{', '.join(InjectSpec.__dataclass_fields__)}; {EXAMPLE}")
        fields[key] = value.strip()
    for key in ("rank", "step"):
        if key not in fields:
            fail(KEY, spec, f"needs {key}=...; {EXAMPLE}")
    for key in ("rank", "step", "index", "bit"):
        if key in fields:
            try:
                fields[key] = int(fields[key])
            except ValueError:
                fail(KEY, spec, f"{key}={fields[key]!r} must be an integer; {EXAMPLE}")
    fields.setdefault("tensor", default_tensor)
    parsed = InjectSpec(**fields)
    if parsed.rank < 0 or parsed.step < 1 or parsed.index < 0 or not 0 <= parsed.bit_in(64) < 64:
        fail(KEY, spec, "needs rank >= 0, step >= 1, index >= 0 and 0 <= bit < 64 (the "
             f"element's bit width bounds it further); {EXAMPLE}")
    if parsed.target not in TARGETS:
        fail(KEY, spec, f"target={parsed.target!r}: use one of {', '.join(TARGETS)}")
    if parsed.kind not in KINDS:
        fail(KEY, spec, f"kind={parsed.kind!r}: use one of {', '.join(KINDS)}")
    return parsed


def check_inject(cfg, world_size: int, precision: str) -> None:
    """The rules that need the rest of the configuration (`cfg`, `world_size` ranks,
    parameters in `precision`): a step the run reaches, a rank it has, a parameter copy that
    the computation reads (zero 3 gathers them from shards instead), and a bit inside the
    element (parameters are 16-bit under bf16/fp16, the local gradients the grad drill flips
    are fp32). Whether the rank holds the tensor, and the element, needs the model
    (`megalite.resilience.inject_target`, run by the preflight)."""
    spec = cfg.resilience.inject
    parsed = parse_inject(spec)
    max_steps = cfg.train.max_steps
    if parsed.step > max_steps:
        fail(KEY, spec, f"step={parsed.step} is beyond train.max_steps={max_steps}: the drill "
             f"would never run; choose a step <= {max_steps}")
    if parsed.rank >= world_size:
        fail(KEY, spec, f"rank={parsed.rank} but the world has {world_size} ranks "
             f"(0..{world_size - 1})")
    if parsed.target == "param" and cfg.zero == 3:
        fail(KEY, spec, "target=param flips the rank's parameter copy, which zero=3 does not "
             "keep (it gathers each block from DP shards); use target=grad or zero <= 2")
    width = 16 if parsed.target == "param" and precision in ("bf16", "fp16") else 32
    if parsed.bit_in(width) >= width:
        held = f"{precision} parameters" if parsed.target == "param" else "fp32 local gradients"
        fail(KEY, spec, f"bit={parsed.bit} is outside the {width}-bit elements of the {held}: "
             f"use a bit < {width} (e.g. bit={width - 2}, the top exponent bit)")
