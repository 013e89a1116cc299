"""PyTorch's own NCCL flight recorder, switched on with `resilience.hang_dump` (launcher-level
environment, never model code). On NCCL a collective that times out is ended by the process
group's watchdog, which aborts the process: megalite's Python-side dump
(`megalite.resilience.hang`) may never run. PyTorch's C++ flight recorder keeps the last
collectives of every NCCL group and, with `TORCH_NCCL_DUMP_ON_TIMEOUT`, writes them before the
abort. It reads its variables from the environment:

    TORCH_NCCL_TRACE_BUFFER_SIZE   entries kept (0: off), read when the NCCL process group is
                                   created: set before it (`megalite.train.runtime.init_runtime`)
    TORCH_NCCL_DUMP_ON_TIMEOUT     dump when the watchdog sees a timeout, read there too
    TORCH_FR_DUMP_TEMP_FILE        the dump's file prefix (the rank is appended); older
    (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)  releases read the second name. Set to
                                   <run dir>/hang/nccl/nccl_trace_rank_ once the run dir is
                                   known (`megalite.train.resilience_services`): the ranks
                                   other than 0 learn it from rank 0 over the process group,
                                   so it cannot precede it. PyTorch reads it when it first
                                   dumps (`DebugInfoWriter::getWriter` creates its writer
                                   lazily), i.e. after this point.

A variable the user has set (either name) is left as it is. Unverified here: no NCCL and no
GPU on the machine this was written on. The dumps are PyTorch's (pickles): read them with
`python -m torch.distributed.flight_recorder.fr_trace <run dir>/hang/nccl -p nccl_trace_rank_`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, MutableMapping, Optional

TRACE_ENTRIES = 2000  # PyTorch's documented example size: the last 2,000 NCCL calls
FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
BUFFER_VARS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
DUMP_VARS = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)


def nccl_dump_dir(run_dir: Path) -> Path:
    """Where PyTorch's NCCL flight recorder dumps, one file per rank (apart from megalite's
    rank*.json: fr_trace reads every file of its directory)."""
    return Path(run_dir) / "hang" / "nccl"


def nccl_flight_env(env: MutableMapping[str, str], run_dir: Optional[Path] = None
                    ) -> Dict[str, str]:
    """The variables to add to `env`, none the user set: without `run_dir` those read when the
    process group is created, with it the dump's file prefix under <run_dir>/hang/nccl/."""
    wanted = []
    if run_dir is None:
        wanted += [(BUFFER_VARS, str(TRACE_ENTRIES)), (DUMP_VARS, "1")]
    else:
        wanted.append((FILE_VARS, str(nccl_dump_dir(run_dir) / "nccl_trace_rank_")))
    return {name: value for names, value in wanted if not any(n in env for n in names)
            for name in names}


def set_nccl_flight_env(run_dir: Optional[Path] = None,
                        env: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set `nccl_flight_env` in `env` (default: this process's); returns what it set. With
    `run_dir`, hang/nccl/ is created there (PyTorch does not create the dump's directory)."""
    env = os.environ if env is None else env
    added = nccl_flight_env(env, run_dir)
    if run_dir is not None and added:
        nccl_dump_dir(run_dir).mkdir(parents=True, exist_ok=True)
    env.update(added)
    return added
