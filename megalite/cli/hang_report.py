"""Print the summary of a run's hang dumps (`<run dir>/hang/rank*.json`, written on a failed
or timed-out collective, or `hang/live/` on `resilience.hang_signal`): the ranks that did not
arrive, the group, and where their main thread was (`megalite.resilience.hang_report`).

    megalite-hang-report outputs/run          # reads outputs/run/hang/rank*.json
    megalite-hang-report outputs/run/hang/live   # the latest live dump
    megalite-hang-report outputs/run --json   # the summary as JSON
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from megalite.resilience.hang_report import load_dumps, summarize


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-hang-report RUN_DIR [--json]`; argv defaults to the command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run directory (or its hang/ or hang/live/)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    hang_dir = args.run_dir / "hang" if (args.run_dir / "hang").is_dir() else args.run_dir
    try:
        states, world_size, request = load_dumps(hang_dir)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
        print(f"megalite: no hang report: {e}", file=sys.stderr)
        sys.exit(2)
    text, summary = summarize(states, world_size, request)
    print(json.dumps(summary, indent=1) if args.json else text)


if __name__ == "__main__":
    main()
