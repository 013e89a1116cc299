"""megalite.utils.log: rank 0 logs by default, every rank with log.all_ranks; one line per message on
stderr, and under Hydra's job logging (conf/hydra/job_logging/megalite.yaml) one in the log
file as well, in the same format."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROBE = """
import logging, logging.config, sys, yaml
from megalite.utils import log
config = yaml.safe_load(open(sys.argv[1]))
config["handlers"]["file"]["filename"] = sys.argv[2]
logging.config.dictConfig(config)  # what Hydra does on rank 0 of a run
log.configure(0)
log.get_logger().info("from megalite")
logging.getLogger("somelib").warning("from another library")
"""


@pytest.mark.distributed
def test_under_hydra_job_logging_each_line_is_written_once_per_sink(tmp_path):
    job_logging = REPO / "conf" / "hydra" / "job_logging" / "megalite.yaml"
    file = tmp_path / "pretrain.log"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(job_logging), str(file)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for sink in (proc.stderr, file.read_text()):
        assert sink.count("from megalite") == 1, sink
        assert sink.count("from another library") == 1, sink
        assert "[megalite][rank 0][INFO] - from megalite" in sink, sink
        assert "[somelib][rank -][WARNING] - from another library" in sink, sink
    assert proc.stdout == ""
