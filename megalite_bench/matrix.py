"""The combination matrix before landing an engine change: a covering array of `--strength`
(default 3: every triple of values of three feature axes that megalite does not refuse is in
some run), each run trained through a checkpoint and a resume against its serial run
(`megalite.testing.matrix`; the axes and refusals: `megalite.config.combinations`;
docs/combinations.md). Prints every run's verdict, the refused combinations it leaves out,
the wall time of each spawn and a summary; exits 1 when a run differs from its serial run (or
a document-masked run read windows where the mask cannot act: the default corpus is of short
documents, `megalite.testing.documents`).
The suite runs strength 2 (tests/integration/train/test_combination_matrix.py).

`--worlds 1 2 4` runs only the runs of those world sizes (a subset: the array's coverage
then holds for them only, and the summary says so).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from megalite.config.combination_search import matrix_rows
from megalite.config.combinations import MATRIX_BASE, labels, world_size
from megalite.config.schema import load_config
from megalite.testing.documents import short_documents
from megalite.testing.matrix import run_matrix


def add_arguments(p) -> None:
    p.add_argument("--strength", type=int, default=3, help="t: every t values covered")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--worlds", type=int, nargs="+", default=None,
                   help="only the runs of these world sizes (default: all, 1 to 8 ranks)")
    p.add_argument("--data", default=None, help="a prepared corpus with a vocabulary of at "
                   "most 1024 whose 32-token windows hold document boundaries (the document-"
                   "masked runs fail without them; default: random short documents written "
                   "into --out)")
    p.add_argument("--out", default=None, help="working directory (default: a temporary one)")


def _changed(row) -> str:
    return ", ".join(f"{k} {v}" for k, v in labels(row).items())


def run(args) -> None:
    start = time.perf_counter()
    out = Path(args.out or tempfile.mkdtemp(prefix="megalite-matrix-"))
    data = Path(args.data) if args.data else short_documents(out / "short-documents")
    base = load_config([*MATRIX_BASE, f"data.dir={data}"])
    rows, refused = matrix_rows(base, args.strength, args.seed)
    chosen = [r for r in rows if args.worlds is None or world_size(r) in args.worlds]
    print(f"strength {args.strength}, seed {args.seed}: {len(rows)} runs in the array, "
          f"{len(chosen)} run here; {len(refused)} combinations refused:")
    for named, why in refused:
        print(f"  refused ({why.kind}): {named}: {why.message}")
    report = run_matrix(base, chosen, out / "runs")
    failed = [i for i, f in report.failures.items() if f]
    for i, row in enumerate(chosen):
        verdict = "differs: " + "; ".join(report.failures[i][:3]) if i in failed else "equal"
        print(f"  [{world_size(row)} ranks] {_changed(row)}: {verdict}")
    spawns = ", ".join(f"{k} {v:.0f} s" for k, v in report.seconds.items())
    subset = "" if len(chosen) == len(rows) else f" (a subset: worlds {args.worlds})"
    print(f"matrix strength {args.strength}{subset}: {len(chosen)} runs, "
          f"{len(chosen) - len(failed)} equal their serial run, {len(failed)} differ; "
          f"wall {time.perf_counter() - start:.0f} s ({spawns})")
    if failed:
        sys.exit(1)
