"""The exit policy of a hardware verdict (`megalite.resilience.faults`), the command's: a run
directory holding resilience/fault.json is refused at start, and a run that ends in a verdict
exits; both with HARDWARE_FAULT_EXIT (EX_TEMPFAIL: retry, elsewhere)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from megalite.cli.refusal import record_error, refuse
from megalite.resilience.faults import (
    FAULT_FILE,
    HARDWARE_FAULT_EXIT,
    HardwareFaultError,
    resilience_dir,
)
from megalite.utils.log import get_logger


def refuse_after_fault(run_dir: Path) -> None:
    """Exit with HARDWARE_FAULT_EXIT, naming the file, while `<run dir>/resilience/fault.json`
    (a hardware verdict of an earlier attempt of this run) exists."""
    path = resilience_dir(run_dir) / FAULT_FILE
    if not path.exists():
        return
    try:
        record = json.loads(path.read_text())
        where = (f" at step {record.get('step')}: a {record.get('kind')} fault on rank "
                 f"{record.get('rank')} (node {record.get('node')}, GPU {record.get('gpu')})")
    except (OSError, ValueError, AttributeError):
        where = ""
    refuse(f"megalite: {path} exists: an earlier attempt of this run stopped on a hardware "
           f"fault{where}. Not starting, so as not to train on that device again. Exclude its "
           f"node (sbatch --exclude=<node>), then move the file aside (mv {path} "
           f"{path.with_name('fault-cleared.json')}) and start again; checkpoint.resume=auto "
           "continues from the last checkpoint.", HARDWARE_FAULT_EXIT)


def fit_or_exit(trainer) -> Optional[list]:
    """`trainer.fit()`; a hardware verdict ends the process with HARDWARE_FAULT_EXIT (the
    error already logged, fault.json written)."""
    try:
        return trainer.fit()
    except HardwareFaultError as e:
        get_logger().error(str(e))
        record_error(f"megalite: hardware fault: {e}")  # torchrun's summary names it
        sys.exit(HARDWARE_FAULT_EXIT)
