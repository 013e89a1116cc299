"""What the planner prints: the search's ranking table, the families that do not fit, the plot;
and which layout keys a command line gives explicitly (the search holds them fixed)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Sequence

from megalite.config.schedule_rules import ZERO_BUBBLE
from megalite.config.schema import Config
from megalite.plan.devices import DeviceProfile
from megalite.plan.memory import GIB
from megalite.plan.search import SearchResult

# command-line key -> (Choice field, how to read it from the configuration)
LAYOUT_KEYS = {
    "tp": ("tp", lambda c: c.tp),
    "cp": ("cp", lambda c: c.cp),
    "parallel.cp_comm": ("cp_comm", lambda c: c.parallel.cp_comm),
    "pp": ("pp", lambda c: c.pp),
    "ep": ("ep", lambda c: c.ep),
    "parallel.rank_order": ("rank_order", lambda c: c.parallel.rank_order),
    "zero": ("zero", lambda c: c.zero),
    "sp": ("sp", lambda c: c.sp),
    "parallel.virtual_stages": ("virtual_stages", lambda c: c.parallel.virtual_stages),
    "train.micro_batch_size": ("micro_batch_size", lambda c: c.train.micro_batch_size),
    "train.recompute": ("recompute", lambda c: c.train.recompute),
    "train.recompute_layers": ("recompute_layers", lambda c: c.train.recompute_layers),
    "offload.activations": ("offload", lambda c: c.offload.activations),
    "offload.activations_layers": ("offload_layers", lambda c: c.offload.activations_layers),
    "offload.optimizer": ("offload_optimizer", lambda c: c.offload.optimizer),
    "parallel.schedule": ("schedule", lambda c: c.parallel.schedule
                          if c.parallel.schedule in ZERO_BUBBLE else "auto"),
}


def explicit_layout_keys(overrides: Sequence[str], cfg: Config) -> Dict[str, object]:
    """{Choice field: value} for the layout keys the overrides set (`tp=2`, `++pp=4`)."""
    fixed = {}
    for override in overrides:
        key = str(override).split("=", 1)[0].lstrip("+~")
        if key in LAYOUT_KEYS:
            field, read = LAYOUT_KEYS[key]
            fixed[field] = read(cfg)
    return fixed


def ranking_table(result: SearchResult, profile: DeviceProfile, world: int,
                  gpus_per_node: int, fixed: Dict[str, object]) -> str:
    lines = [f"search: {world} x {profile.name} ({gpus_per_node} per node, "
             f"{profile.memory_bytes / GIB:.1f} GiB each; {profile.source}): "
             f"{result.valid} candidates within the memory bound, {result.costed} predicted, "
             f"top {len(result.best)} (fastest first)"]
    if result.masked_work is not None:
        lines.append(f"{result.masked_work.describe()}: every layout's attention priced with "
                     "it (cp = 1: the masked kernel's work x its ratio; cp > 1: what the CP "
                     "kernels skip)")
    experts = any(r.choice.ep > 1 for r in result.best)  # an ep column where one is ranked
    if fixed:
        lines.append("held fixed (given on the command line): "
                     + ", ".join(f"{k}={v}" for k, v in fixed.items()))
    lines.append(f"{'#':>2} {'tp':>3} {'cp':>6} {'pp':>3} {'dp':>5} {'zero':>4} {'sp':>3} {'v':>2} "
                 f"{'zb':>2}" + (f" {'ep':>3} {'order':>5}" if experts else "")
                 + f" {'mb':>3} {'rec':>3} {'off':>3} {'oo':>4} {'GiB':>6} {'step s':>8} "
                 f"{'tok/s':>10} "
                 f"{'TF/s':>6} {'hwTF/s':>6} {'MFU':>5}  time split s (critical)")
    for i, r in enumerate(result.best, 1):
        c, p = r.choice, r.prediction
        split = " ".join(f"{k} {v:.3g}" for k, v in p.terms.items() if v > 0)
        mfu = f"{p.mfu:.0%}" if p.mfu is not None else "n/a"
        lines.append(
            f"{i:>2} {c.tp:>3} {_cp(c.cp, c.cp_comm):>6} {c.pp:>3} {c.dp:>5} {c.zero:>4} "
            f"{'y' if c.sp else 'n':>3} "
            f"{c.virtual_stages:>2} {c.schedule[3:] if c.zero_bubble else 'n':>2}"
            + (f" {c.ep:>3} {c.rank_order[-5:]:>5}" if experts else "")
            + f" {c.micro_batch_size:>3} {_count(c.recompute, c.recompute_layers):>3} "
            f"{_count(c.offload, c.offload_layers):>3} {c.offload_optimizer:>4g} "
            f"{r.peak_bytes / GIB:>6.1f} {p.step_s:>8.4g} "
            f"{p.tokens_per_s:>10,.0f} {p.model_tflops_per_device:>6.1f} "
            f"{p.hardware_tflops_per_device:>6.1f} {mfu:>5}  {split} ({p.critical_term})")
    if result.best:
        lines.append("run the first with: " + " ".join(result.best[0].choice.overrides()))
    lines.append(f"not planned: {result.valid - result.costed} whose time lower bound (compute "
                 "+ recompute + the blocks' TP bytes, and the bubble) is above the top's "
                 "predictions; "
                 f"{sum(1 for p in result.points if p[2] == 'predicted')} predicted slower; "
                 f"{result.unreached} never reached (their time lower bound is above, their "
                 f"memory not checked); {result.unexpanded} (tp, cp, pp, dp) never expanded "
                 "(a bound below all their layouts' is above)")
    if result.too_big:
        lines.append("over the device memory, per family: how many, and the least memory per "
                     "rank one of them needs (a lower bound unless planned): " + "; ".join(
                         f"{f}: {result.too_big_count[f]}, {b / GIB:.1f} GiB"
                         for f, b in sorted(result.too_big.items())))
    for message, count in result.invalid.items():
        lines.append(f"refused by the launch validation ({count}): {message}")
    return "\n".join(lines)


def _cp(cp: int, comm: str) -> str:
    """A ranking cell for context parallelism: 1, or cp and its comm's initial (2a: all-gather,
    2r: ring)."""
    return "1" if cp == 1 else f"{cp}{comm[0]}"


def _count(on: bool, layers) -> str:
    """A ranking cell for recompute / activation offload: n, y (every block) or the count."""
    return "n" if not on else "y" if layers is None else str(layers)


def plot_search(result: SearchResult, profile: DeviceProfile, path: Path) -> None:
    """Predicted step time vs peak memory per rank of the candidates the search looked at
    (planned ones exact; the others at their bounds), the chosen one marked, the device's
    memory drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xy(kind: str) -> tuple:
        pts = [(b / GIB, s) for b, s, k in result.points if k == kind and math.isfinite(s)]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(*xy("bound"), s=5, c="0.75", label="not costed: memory and time lower bounds")
    ax.scatter(*xy("predicted"), s=8, c="tab:cyan",
               label="predicted, memory lower bound (slower than the top)")
    ax.scatter(*xy("planned"), s=14, c="tab:blue", label="planned and predicted")
    if result.best:
        best = result.best[0]
        ax.scatter([best.peak_bytes / GIB], [best.prediction.step_s], s=120, marker="*",
                   c="tab:red", label="chosen: " + best.choice.describe(), zorder=3)
    ax.axvline(profile.memory_bytes / GIB, color="k", ls="--",
               label=f"{profile.name} memory")
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
