"""An optimizer offload's timeline (`megalite.parallel.offload_timeline` spans, as
`megalite-bench offload` reports them) drawn in text, one line per kind over the timed steps:
`#` where a span of that kind covers the column, `.` where none does; the steps' line numbers
each step's columns. What `megalite-bench gpu`'s offload part puts in the report."""
from __future__ import annotations

from typing import List

ROWS = ("step", "d2h", "host_step", "h2d", "wait")


def draw(spans: List[dict], width: int = 72) -> List[str]:
    """The lines of the drawing (none without spans); each column is end / width seconds."""
    if not spans:
        return []
    end = max(s["end_s"] for s in spans)
    if end <= 0:
        return []
    lines = [f"{'seconds':>9} 0 .. {end:.4g} ({end / width:.3g} s a column)"]
    for kind in ROWS:
        cells = ["."] * width
        for s in (s for s in spans if s["kind"] == kind):
            first = min(width - 1, int(s["start_s"] / end * width))
            last = min(width - 1, max(first, int(s["end_s"] / end * width - 1e-9)))
            for c in range(first, last + 1):
                cells[c] = str(s["range"] % 10) if kind == "step" else "#"
        lines.append(f"{kind:>9} {''.join(cells)}")
    return lines
