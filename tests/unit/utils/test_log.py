"""megalite.utils.log: rank 0 logs by default, every rank with log.all_ranks; one line per message on
stderr, and under Hydra's job logging (conf/hydra/job_logging/megalite.yaml) one in the log
file as well, in the same format."""
from __future__ import annotations

import contextlib
import io

import pytest

from megalite.utils import log


@pytest.fixture
def restore_logger():
    """The megalite logger as it was (other tests' build_trainer configured it)."""
    logger = log.get_logger()
    handlers, filters, level = list(logger.handlers), list(logger.filters), logger.level
    yield
    logger.handlers[:], logger.filters[:] = handlers, filters
    logger.setLevel(level)


def test_rank_0_logs_the_others_only_when_asked(restore_logger, capsys):
    log.configure(0)
    log.get_logger().info("step 3")
    err = capsys.readouterr().err
    assert err.count("[megalite][rank 0][INFO] - step 3\n") == 1, err
    log.configure(1)
    log.get_logger().warning("not shown")
    assert capsys.readouterr().err == ""
    log.configure(1, all_ranks=True)
    log.configure(1, all_ranks=True)  # again: still one handler
    log.get_logger().warning("shown")
    err = capsys.readouterr().err
    assert err.count("[megalite][rank 1][WARNING] - shown\n") == 1, err


def test_the_console_is_stderr_at_the_time_of_the_line(restore_logger, capsys):
    log.configure(0)
    redirected = io.StringIO()
    with contextlib.redirect_stderr(redirected):
        log.get_logger().info("after a redirect")
    assert redirected.getvalue().rstrip().endswith("after a redirect")
    assert "after a redirect" not in capsys.readouterr().err
