"""`megalite-torchrun`: torchrun, ending the way a user and a scheduler can read.

    megalite-torchrun --standalone --nproc_per_node=8 scripts/pretrain.py model=gpt2
    python -m megalite.cli.torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d ... \\
        scripts/pretrain.py ...

The arguments are torchrun's (`torch.distributed.run`'s parser and launch, unchanged). Plain
torchrun ends every failed run with about 40 lines (its own Python traceback and a summary
per failed rank) and exits 1 whatever its workers exited with, so a scheduler cannot tell a
hardware fault (`HARDWARE_FAULT_EXIT`, 75: retry elsewhere) from a bug or a bad configuration
(2). Here a failed run ends in a short summary, one line per distinct reason with the ranks
that gave it (the message a rank recorded in its torchrun error file, `megalite.cli.refusal`,
or its exit code or signal), and the exit status is:

- 75 when any failed worker exited 75 (a hardware verdict: retry on other nodes);
- otherwise the exit status of the first worker that exited by itself (2: a bad
  configuration; the agent then stops the others with SIGTERM), or 128 + the signal that
  killed the first (the shell's convention).
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megalite.resilience.faults import HARDWARE_FAULT_EXIT


def reason(failure) -> str:
    """One line saying why a worker failed (a torch ProcessFailure)."""
    message = failure.message
    if isinstance(message, dict):  # a Python exception recorded by torch's @record
        message = message.get("message", "")
    line = str(message or "").strip().splitlines()
    if line and not line[0].startswith("To enable traceback"):  # torch's own filler
        return line[0]  # a rank's message, or torch's for a signal ("Signal 9 (SIGKILL) ...")
    return f"exit {failure.exitcode}, no error recorded (its output above says why)"


def exit_status(failures: Dict[int, object]) -> int:
    """The status to exit with: 75 if any worker exited 75; else the status of the first
    worker (by time) that exited by itself (the agent's SIGTERM ends the others); else 128 +
    the first signal."""
    ordered = sorted(failures.values(), key=lambda f: f.timestamp)
    codes = [f.exitcode for f in ordered]
    if HARDWARE_FAULT_EXIT in codes:
        return HARDWARE_FAULT_EXIT
    exited = [c for c in codes if c > 0]
    return exited[0] if exited else 128 - codes[0] if codes[0] < 0 else 1


def summary(failures: Dict[int, object]) -> str:
    """A line per distinct reason: the ranks (and their exit statuses) that gave it."""
    groups: Dict[str, List[Tuple[int, int]]] = {}
    for rank in sorted(failures):
        groups.setdefault(reason(failures[rank]), []).append((rank, failures[rank].exitcode))
    lines = [f"megalite-torchrun: {len(failures)} worker(s) failed"]
    for why, ranks in groups.items():
        which = ", ".join(str(r) for r, _ in ranks)
        codes = ", ".join(sorted({str(c) for _, c in ranks}))
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {which} (exit {codes}): {why}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Launch as torchrun does; a failed run prints `summary` and exits with `exit_status`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        print(summary(e.failures), file=sys.stderr)
        sys.exit(exit_status(e.failures))


if __name__ == "__main__":
    main()
