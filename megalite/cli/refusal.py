"""How a command's rank says why it stops: one line on stderr, and the same line recorded for
torchrun's agent.

torchrun gives each worker an error file (`TORCHELASTIC_ERROR_FILE`, torch.distributed.elastic's
error-file protocol); a message recorded there is what torchrun's failure summary shows for the
rank (in place of "error_file: <N/A>") and what `megalite-torchrun` (`megalite.cli.torchrun`)
prints. Under torchrun only each node's local rank 0 prints the line itself (a configuration
error is the same on every rank: one line a node, not one a rank); every rank records it.
Without torchrun the line is printed and nothing is recorded.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by torchrun's agent for each worker


def record_error(message: str) -> None:
    """Write `message` to this worker's torchrun error file (nothing without torchrun)."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line on stderr still says it; the agent then reports the exit code alone


def prints_here() -> bool:
    """Whether this rank prints its refusal: always without torchrun, local rank 0 under it."""
    return ERROR_FILE not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"


def say(message: str) -> None:
    """Record `message` for torchrun and print it (once a node under torchrun)."""
    record_error(message)
    if prints_here():
        print(message, file=sys.stderr, flush=True)


def refuse(message: str, code: int) -> NoReturn:
    """Say `message` (a line starting "megalite:") and exit with `code`."""
    say(message)
    sys.exit(code)
