"""Who a process is in the job, from its launcher: torchrun's variables as they are; a Slurm
launch without torchrun translated (else every task would train alone); what cannot work
refused before any work, naming the variables."""
from __future__ import annotations

import pytest

from megalite.cli.launch_env import LaunchEnv, exported, first_host, launch_env
from megalite.config.errors import ConfigError

SLURM = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}


def test_a_slurm_launch_without_torchrun_becomes_one_world():
    launch = launch_env(SLURM)
    assert launch == LaunchEnv(5, 8, 1, 4, "gpu07", 29500 + 4242, "slurm")
    assert exported(launch) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07",
                                "MASTER_PORT": "33742"}
    assert launch_env({**SLURM, "MASTER_PORT": "6000"}).master_port == 6000
    assert launch_env({**SLURM, "SLURM_NTASKS": "1"}) == LaunchEnv()  # one task: a world of one
    batch_script = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert launch_env(batch_script) == LaunchEnv()  # sbatch's script itself is no rank
    assert launch_env({**SLURM, "SLURM_STEP_ID": "4294967294"}) == LaunchEnv()
    bound = launch_env(SLURM, gpus=1)  # --gpus-per-task=1: the task's one GPU is cuda:0
    assert (bound.rank, bound.local_rank, bound.local_world_size) == (5, 0, 1)


def test_torchrun_variables_win_and_disagreement_is_refused():
    torchrun = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                "TORCHELASTIC_RUN_ID": "x"}
    # one torchrun agent per node under srun: SLURM_PROCID is the node, not the rank
    assert launch_env({**SLURM, **torchrun}).rank == 3
    assert exported(launch_env(torchrun)) == {}
    with pytest.raises(ConfigError, match="RANK=3 but SLURM_PROCID=5"):
        launch_env({**SLURM, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})


def test_rank_without_local_rank_needs_one_gpu_per_process():
    assert launch_env({"RANK": "1", "WORLD_SIZE": "2"}, gpus=1).local_rank == 0
    with pytest.raises(ConfigError, match="RANK=1 without LOCAL_RANK .* 8 GPUs"):
        launch_env({"RANK": "1", "WORLD_SIZE": "2"}, gpus=8)
    with pytest.raises(ConfigError, match="WORLD_SIZE is not"):
        launch_env({"RANK": "1"})
    with pytest.raises(ConfigError, match="SLURM_LOCALID"):
        launch_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                    "SLURM_JOB_NODELIST": "a1"})


@pytest.mark.parametrize("nodes,first", [("gpu[07-08]", "gpu07"), ("n1,n2", "n1"),
                                          ("rack2-[003,010-012]", "rack2-003"), ("solo", "solo")])
def test_first_host_of_a_slurm_hostlist(nodes, first):
    assert first_host(nodes) == first
