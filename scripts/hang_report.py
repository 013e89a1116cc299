#!/usr/bin/env python
"""The summary of a run's hang dumps: which ranks did not arrive, and in which group.

    python scripts/hang_report.py outputs/run          # reads outputs/run/hang/rank*.json
    python scripts/hang_report.py outputs/run --json

The `megalite-hang-report` command of an installed megalite, whose code
(megalite/cli/hang_report.py) this file runs.
"""
from megalite.cli.hang_report import main

if __name__ == "__main__":
    main()
