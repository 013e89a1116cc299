"""`megalite-bench gpu`'s fp8 part: the big preset compiled on the launch path in bf16 and with
each FP8 recipe (`fp8.recipe`), one after the other from the same weights and data: tokens/s
over bf16's (the issue's goal: >= 1.2x on gpt2-xl), each step's loss against bf16's at the same
step (the goal: within 1%), MFU (against the dense bf16 peak in every run), peak memory
against the plan. Second in priority, after the CUDA tests: FP8's speed has never been measured
(alone: `megalite-bench gpu --parts fp8 --budget-s 540`, three compiled gpt2-xl runs)."""
from __future__ import annotations

from typing import List, Optional

from megalite_bench.gpu_mfu import RunSpec, fill, train_overrides
from megalite_bench.gpu_report import Part
from megalite_bench.gpu_session import GpuSession
from megalite_bench.gpu_sizes import Sizes

RECIPES = ("none", "tensorwise", "rowwise")


def fp8_overrides(s: Sizes, recipe: str) -> List[str]:
    """One run's configuration: the big preset, compiled where the form compiles, dropout 0
    (losses comparable step by step), and the recipe (emulated in the reduced, CPU form)."""
    spec = RunSpec(f"fp8 {recipe}", "launch", s.big, s.compiles[0], "0")
    extra = [f"fp8.recipe={recipe}"] if recipe != "none" else []
    if extra and s.device:  # the reduced form: a CPU
        extra.append("fp8.emulate=true")
    return train_overrides(s, spec) + extra


def loss_gap(losses: List[float], reference: List[float]) -> Optional[float]:
    """The largest relative difference of two runs' losses at the same steps."""
    pairs = list(zip(losses, reference))
    return max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None


def fp8(bench: GpuSession, part: Part) -> None:
    s = bench.sizes
    if bench.ensure_data(part) is None:
        part.status = "skipped: no corpus"
        return
    limit = s.limits["launch-compiled" if s.compiles[0] else "launch"]
    base: dict = {}
    for recipe in RECIPES:
        overrides = fp8_overrides(s, recipe)
        ran, got = bench.launch(part, f"fp8 {s.big} {recipe}", overrides, limit)
        losses = [r["loss"] for r in got.pop("records", [])]
        row = {"run": f"{s.big} fp8.recipe={recipe}", "status": got.get("error") or ran.status()}
        fill(bench, row, got, overrides)
        if recipe == "none":
            base = {"tokens_per_s": row.get("tokens_per_s"), "losses": losses}
        elif base.get("tokens_per_s") and row.get("tokens_per_s"):
            row["tokens_per_s_over_bf16"] = row["tokens_per_s"] / base["tokens_per_s"]
        if recipe != "none":
            row["loss_gap_to_bf16"] = loss_gap(losses, base.get("losses", []))
        part.rows.append(row)
        bench.report.write()
        if not ran.ok:
            part.notes.append(f"{row['run']}: {ran.tail()}")
    ok = sum(1 for r in part.rows if str(r["status"]).startswith("ok"))
    part.status = "ok" if ok == len(RECIPES) else f"partial: {ok} of {len(RECIPES)} runs ok"
    part.notes.append("loss_gap_to_bf16: the largest relative difference of a step's loss "
                      "from the bf16 run's at the same step (every step the run logged); "
                      "tokens_per_s_over_bf16 over the timed steps' medians; mfu against the "
                      "dense bf16 peak in all three runs")
