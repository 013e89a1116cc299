"""megalite-torchrun's ending: a line per distinct reason, and the exit status a scheduler can
act on (75 for a hardware fault, else the first worker's own status); the rank's side records
its refusal in torchrun's error file."""
import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megalite.cli.refusal import ERROR_FILE, refuse
from megalite.cli.torchrun import exit_status, summary


def failure(tmp_path, rank, exitcode, message=None, timestamp=0):
    path = tmp_path / f"error{rank}{exitcode}.json"
    if message is not None:
        path.write_text(json.dumps({"message": message, "timestamp": timestamp}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                          error_file=str(path))


def test_a_hardware_fault_wins_and_a_signal_is_not_the_cause(tmp_path):
    bad = "megalite: bad configuration: parallel.cp_comm='bogus': one of allgather, ring"
    # the agent's SIGTERM (-15) of rank 0 came after rank 1 exited 2 by itself
    refused = {0: failure(tmp_path, 0, -15, bad, 1), 1: failure(tmp_path, 1, 2, bad, 2)}
    assert exit_status(refused) == 2
    assert summary(refused).splitlines() == ["megalite-torchrun: 2 worker(s) failed",
                                             f"  ranks 0, 1 (exit -15, 2): {bad}"]
    fault = {0: failure(tmp_path, 0, 1, None, 1), 1: failure(tmp_path, 1, 75, "hw", 2)}
    assert exit_status(fault) == 75
    assert "rank 0 (exit 1): exit 1, no error recorded" in summary(fault)
    assert exit_status({0: failure(tmp_path, 0, -9)}) == 128 + 9
    assert "(exit -9): Signal 9 (SIGKILL) received" in summary({0: failure(tmp_path, 0, -9)})


def test_a_refusal_is_recorded_for_torchrun_and_printed_once_a_node(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv(ERROR_FILE, str(tmp_path / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as e:
        refuse("megalite: bad configuration: tp=3: ...", 2)
    assert e.value.code == 2 and capsys.readouterr().err == ""  # local rank 0 prints it
    assert ProcessFailure(1, 1, 2, str(tmp_path / "error.json")).message == \
        "megalite: bad configuration: tp=3: ..."
