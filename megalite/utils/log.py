"""megalite's messages (resuming, checkpoint fallbacks, stops, warnings) go through one stdlib
`logging` logger, named "megalite", instead of print.

`configure(rank, all_ranks)` sets it up for a process: rank 0 logs (INFO and up) and the other
ranks are silent, or with `all_ranks` (config `log.all_ranks=true`) every rank logs. Lines go
to stderr in FORMAT, each naming its rank. Calling it again replaces what the previous call
set; `megalite-pretrain` calls it once the config is read, `build_trainer` with the run's rank.

The logger propagates to the root logger, which Hydra's job logging sets up on rank 0 of a
training run (conf/hydra/job_logging/megalite.yaml): a file handler writing the same FORMAT to
`<run dir>/pretrain.log`, and a console handler for other libraries' records that leaves
megalite's to megalite's own handler (`OtherLoggers`). So a megalite line is written once to
the console and once to pretrain.log. Without `configure` (megalite used as a library) the
application's logging decides; plain Python shows warnings and errors only.
"""
from __future__ import annotations

import logging
import sys

NAME = "megalite"
# Hydra's default job-logging format, plus the rank (records of other loggers show "rank -")
FORMAT = "[%(asctime)s][%(name)s][rank %(rank)s][%(levelname)s] - %(message)s"
SILENT = logging.CRITICAL + 1  # the level of a rank that does not log


def get_logger() -> logging.Logger:
    """The megalite logger (one for the whole library, so every record carries the rank)."""
    return logging.getLogger(NAME)


class Formatter(logging.Formatter):
    """FORMAT, for megalite's console handler and Hydra's job-logging handlers alike."""

    def __init__(self) -> None:
        super().__init__(FORMAT, defaults={"rank": "-"})


class ConsoleHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (a redirect or a test's capture), not as it
    was when the handler was made."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(Formatter())

    @property
    def stream(self):
        return sys.stderr


class RankFilter(logging.Filter):
    """Stamps each record of the megalite logger with this process's rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class OtherLoggers(logging.Filter):
    """For a console handler on the root logger: every record but megalite's, which megalite's
    own ConsoleHandler prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != NAME and not record.name.startswith(NAME + ".")


def configure(rank: int, all_ranks: bool = False) -> logging.Logger:
    """Set up the megalite logger for this process: rank 0 logs INFO and up to stderr (and,
    through the root logger, wherever the application sends records), other ranks only with
    `all_ranks`. Idempotent: replaces the handler and filter of a previous call."""
    logger = get_logger()
    for old in [f for f in logger.filters if isinstance(f, RankFilter)]:
        logger.removeFilter(old)
    for old in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(old)
    logger.addFilter(RankFilter(rank))
    logger.addHandler(ConsoleHandler())
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else SILENT)
    logger.propagate = True
    # Hydra's disabled job logging (ranks > 0, data preparation) disables existing loggers
    logger.disabled = False
    return logger
