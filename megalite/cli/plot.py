"""Plot runs' metrics.jsonl: loss, validation loss, HellaSwag accuracy, tokens/s, MFU and an MoE
run's expert load against the tokens trained on, one or several runs overlaid, into a PNG (for
users without wandb).

    megalite-plot outputs/run                                # -> outputs/run/metrics.png
    megalite-plot outputs/run-a outputs/run-b --out runs.png

(`python scripts/plot.py ...` in a checkout is the same command.) Each run is a run directory
(hydra.run.dir) holding metrics.jsonl; a resumed run's history is read as its last launch sees
it (`megalite.train.metrics_file`). The legend names each run by its directory (with as much of
the parent path as tells two same-named directories apart). A panel whose metric no run logged
is left out (HellaSwag needs eval.hellaswag; MFU needs a known peak; the expert load an MoE
model). Needs matplotlib (the `eval` extra: pip install -e ".[eval]" in a checkout); draws with
the Agg backend, no display needed.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megalite.train.metrics_file import MetricsFileError, metric, run_records
from megalite.utils.extras import install_hint

# (panel title, [(metric, line style)], y-axis scale factor, y label)
PANELS = (
    ("train loss", [("loss", "-")], 1.0, "loss"),
    ("validation loss", [("val_loss", "-")], 1.0, "loss"),
    ("HellaSwag (solid: acc, dashed: acc_norm)",
     [("hellaswag_acc", "-"), ("hellaswag_acc_norm", "--")], 1.0, "accuracy"),
    ("throughput", [("tokens_per_s", "-")], 1.0, "tokens/s"),
    ("MFU", [("mfu", "-")], 100.0, "% of peak"),
    ("expert load: max / mean tokens per expert, worst MoE layer", [("moe_imbalance", "-")],
     1.0, "imbalance (1 = balanced)"),
)


def labels(run_dirs: Sequence[Path]) -> List[str]:
    """Each directory's name, or its shortest path suffix that no other directory shares."""
    paths = [p.resolve().parts for p in run_dirs]
    out = []
    for parts in paths:
        for n in range(1, len(parts) + 1):
            suffix = parts[-n:]
            if sum(other[-n:] == suffix for other in paths) == 1 or n == len(parts):
                out.append("/".join(suffix))
                break
    return out


def tokens(record: dict, header: dict) -> float:
    """The tokens trained on up to this record (older files: step x tokens per step)."""
    value = metric(record, "consumed_tokens")
    return value if value is not None else record["step"] * header["tokens_per_step"]


def read_runs(run_dirs: Sequence[Path]) -> List[Tuple[str, List[Tuple[float, dict]]]]:
    """(label, [(tokens, record)]) of every run; every directory checked before any drawing."""
    runs = []
    for label, run_dir in zip(labels(run_dirs), run_dirs):
        header, records = run_records(run_dir)
        if not records:
            raise MetricsFileError(f"{run_dir}: metrics.jsonl has no metric lines yet (a run "
                                   "writes one every log.every steps)")
        runs.append((label, [(tokens(r, header), r) for r in records]))
    return runs


def draw(runs, out: Path) -> None:
    """The panels with data, two columns, written to `out` (complete or not at all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    panels = [p for p in PANELS if any(metric(r, name) is not None for name, _ in p[1]
                                       for _, records in runs for _, r in records)]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.6 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, series, scale, ylabel) in zip(axes.flat, panels):
        for i, (label, records) in enumerate(runs):
            for name, style in series:
                points = [(x, metric(r, name) * scale) for x, r in records
                          if metric(r, name) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, style, color=colors[i % len(colors)], marker=".",
                            label=label if style == "-" else None)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-plot RUN_DIR... [--out PNG]`; argv defaults to the command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default with one run: "
                        "<run dir>/metrics.png; required with several)")
    args = parser.parse_args(argv)
    if args.out is None and len(args.run_dirs) > 1:
        parser.error(f"{len(args.run_dirs)} runs: say where the plot goes with --out PATH.png")
    out = args.out or args.run_dirs[0] / "metrics.png"
    if out.suffix.lower() != ".png":
        parser.error(f"--out {out}: the plot is a PNG; give a path ending in .png")
    try:
        runs = read_runs(args.run_dirs)
    except MetricsFileError as e:
        print(f"megalite: cannot plot: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        draw(runs, out)
    except ImportError as e:
        print(f"megalite: cannot plot: {e}; matplotlib comes with the eval extra: "
              f"{install_hint('eval')} (or pip install matplotlib)", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out} ({len(runs)} run{'s' * (len(runs) > 1)})")


if __name__ == "__main__":
    main()
