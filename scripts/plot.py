#!/usr/bin/env python
"""Plot runs' metrics.jsonl: loss, validation loss, HellaSwag accuracy, tokens/s and MFU against
tokens, one or several runs overlaid, into a PNG.

    python scripts/plot.py outputs/run                               # -> outputs/run/metrics.png
    python scripts/plot.py outputs/run-a outputs/run-b --out runs.png

The `megalite-plot` command of an installed megalite (`pip install -e ".[eval]"`: matplotlib),
whose code (megalite/cli/plot.py) this file runs.
"""
from megalite.cli.plot import main

if __name__ == "__main__":
    main()
