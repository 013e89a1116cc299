"""A CPU rank's intra-op threads (`megalite.train.host_threads.cpu_thread_choice`): the user's
setting first, then OMP_NUM_THREADS, else the cores the others' load leaves, per local rank,
less the offload worker's; and the key's refusal."""
import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.host_threads import cpu_thread_choice, set_cpu_threads


@pytest.mark.parametrize("setting,env,cores,load,ranks,worker,threads", [
    (None, {}, 2, 0.1, 1, False, 2),  # a quiet 2-core machine: torch's default, both cores
    (None, {}, 2, 5.0, 1, False, 1),  # loaded (the quickstart 2-10x slower on 2 threads)
    (None, {}, 2, 1.4, 1, False, 1),
    (None, {}, 16, 0.0, 4, False, 4),  # four local ranks share the cores
    (None, {}, 16, 0.0, 4, True, 3),  # each with an offload.optimizer worker thread
    (None, {}, 16, 40.0, 4, False, 1),  # never below 1
    (None, {"OMP_NUM_THREADS": "3"}, 16, 0.0, 1, False, None),  # the user's: kept
    (6, {"OMP_NUM_THREADS": "3"}, 2, 5.0, 1, False, 6),  # cpu_threads= wins
])
def test_cpu_threads_from_the_free_cores_per_local_rank(setting, env, cores, load, ranks,
                                                         worker, threads):
    assert cpu_thread_choice(setting, env, cores, load, ranks, worker)[0] == threads


def test_set_cpu_threads_sets_torch_and_leaves_cuda(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert set_cpu_threads(1, 0.0, torch.device("cpu")) == 1
        assert torch.get_num_threads() == 1
        assert set_cpu_threads(1, 0.0, torch.device("cpu")) is None  # unchanged
        assert set_cpu_threads(1, 0.0, torch.device("cuda")) is None
    finally:
        torch.set_num_threads(before)


def test_a_bad_cpu_threads_is_refused():
    with pytest.raises(ConfigError, match="cpu_threads=0: must be a positive integer"):
        validate(load_config(["cpu_threads=0"]), 1)
