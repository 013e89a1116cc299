"""Rerun attribution (megalite.resilience.rerun) and its fault drills (resilience.inject): a
suspicious step is re-executed before its optimizer step; a transient fault is pinned on the
rank that computed wrong (fault.json, the hardware exit code), a persistent one on the replica
that recomputes another's micro-batches wrong, bad data is logged, skipped and counted."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from megalite.config.errors import ConfigError
from megalite.config.inject import InjectSpec, parse_inject
from megalite.config.layout import Layout, validate
from megalite.config.schema import check_sections, load_config
from megalite.resilience.faults import HARDWARE_FAULT_EXIT
from megalite.resilience.inject import flip_bit
from megalite.resilience.inject_target import check_inject_target
from megalite.resilience.spikes import SpikeDetector
from megalite.resilience.verdicts import (
    agree,
    cross_replica_verdict,
    nondeterministic,
    own_changes,
    replica_domains,
    transient_suspects,
)


def test_spikes_are_judged_against_the_running_median_after_the_warmup():
    d = SpikeDetector(spikes=True, factor=3.0, window=3, warmup=2)
    assert d.suspicious({"grad_norm": 100.0}) == []  # nothing recorded: no median yet
    d.record({"grad_norm": 1.0, "loss": 5.0})
    assert d.suspicious({"grad_norm": 100.0}) == []  # in the warm-up
    d.record({"grad_norm": 2.0, "loss": 5.0})
    assert d.suspicious({"grad_norm": 4.4, "loss": 5.0}) == []  # 4.4 <= 3 x median 1.5
    assert len(d.suspicious({"grad_norm": 4.6})) == 1
    for v in (10.0, 10.0, 10.0):  # the window keeps the last 3: median 10
        d.record({"grad_norm": v})
    assert d.suspicious({"grad_norm": 29.0}) == [] and d.suspicious({"grad_norm": 31.0})
    assert d.suspicious({"loss": float("nan")}) == ["loss nan"]
    nan_only = SpikeDetector(spikes=False, factor=3.0, window=3, warmup=None)
    nan_only.record({"grad_norm": 1.0})
    assert nan_only.suspicious({"grad_norm": 1e9}) == []
    assert nan_only.suspicious({"grad_norm": float("inf")}) == ["grad_norm inf"]


def test_the_spike_statistics_survive_a_state_dict_round_trip():
    a = SpikeDetector(spikes=True, factor=2.0, window=4, warmup=3)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        a.record({"grad_norm": v, "loss": v + 1})
    b = SpikeDetector(spikes=True, factor=2.0, window=4, warmup=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as meta.json carries it
    assert b.state_dict() == a.state_dict()
    for probe in ({"grad_norm": 7.1}, {"grad_norm": 6.9}, {"loss": 9.5}):
        assert b.suspicious(probe) == a.suspicious(probe)
    assert a.suspicious({"grad_norm": 7.1}) and not a.suspicious({"grad_norm": 6.9})


def test_a_transient_fault_is_pinned_on_the_ranks_whose_own_results_changed():
    nan = math.nan
    first = [[2.0, 1.0, 5.0], [nan, nan, nan], [2.5, 1.5, 5.0]]
    second = [[2.0, 1.0, 4.0], [2.2, 1.2, 4.0], [2.5, 1.5, 4.0]]
    assert transient_suspects(first, second, 0.0) == [1]  # the reduced grads changed on all
    assert transient_suspects(first, first, 0.0) == []  # NaN reproduced is no change
    only_reduced = [[2.0, 1.0, 5.0], [2.2, 1.2, 9.0]]
    assert transient_suspects(only_reduced, [[2.0, 1.0, 5.0], [2.2, 1.2, 5.0]], 0.0) == [1]
    assert agree(1.0, 1.0 + 1e-9, 1e-6) and not agree(1.0, 1.0 + 1e-9, 0.0)
    assert not agree(math.inf, 3.0, 1e-5) and agree(math.inf, math.inf, 1e-5)


def test_own_changes_in_two_replicas_are_non_determinism_and_in_one_a_fault():
    first = [[2.0, 1.0, 5.0], [2.5, 1.5, 5.0], [3.0, 1.0, 5.0], [3.5, 1.5, 5.0]]
    rounding = [[2.0 * (1 + 1e-4), 1.0, 5.1], [2.5, 1.5, 5.1], [3.0, 1.0, 5.1],
                [3.5, 1.5 * (1 - 1e-4), 5.1]]
    replicas = [[0, 1], [2, 3]]  # tp 2 x dp 2
    changed = own_changes(first, rounding, 1e-5)
    assert changed == [0, 3] and nondeterministic(changed, replicas)
    assert not nondeterministic(changed, replicas, shards_parameters=True)  # zero 3 gathers
    assert own_changes(first, rounding, 1e-3) == []  # within a looser tolerance: no change
    fault = [[math.nan, 1.0, 5.1], [2.5, 2.0, 5.1], [3.0, 1.0, 5.1], [3.5, 1.5, 5.1]]
    assert not nondeterministic(own_changes(first, fault, 1e-5), replicas)  # one replica
    assert transient_suspects(first, fault, 1e-5) == [0, 1]


def test_the_cross_replica_recomputation_tells_a_persistent_fault_from_the_data():
    nan, ok = math.nan, [2.0, 1.0, 0.0]
    replicas = [[0], [1]]
    # the data: both replicas reproduce each other's results, NaN included
    assert cross_replica_verdict([ok, [nan, nan, 0]], [[nan, nan, 0], ok], replicas, 0) == []
    # replica 1 computes NaN on any data, replica 0 computes replica 1's data fine
    assert cross_replica_verdict([ok, [nan, nan, 0]], [[3.0, 1.0, 0], [nan, nan, 0]],
                                 replicas, 0) == [1]
    # three replicas, replica 2 wrong on everything it computes (finite): the one in two pairs
    first = [[1.0, 1, 0], [2.0, 1, 0], [3.5, 1, 0]]
    recomputed = [[3.0, 1, 0], [1.0, 1, 0], [2.5, 1, 0]]  # replica d + 1 recomputes d's data
    assert cross_replica_verdict(first, recomputed, [[0], [1], [2]], 0) == [2]
    # two replicas, finite and disagreeing both ways: either may be wrong, both are named
    assert cross_replica_verdict([[1.0, 1, 0], [2.0, 1, 0]], [[2.5, 1, 0], [1.5, 1, 0]],
                                 replicas, 0) == [0, 1]


def test_under_expert_parallelism_the_replicas_an_ep_group_joins_are_one_domain():
    """The replicas a fault reaches through the token exchange: ep 2 over dp 4 joins replicas
    0-1 and 2-3; ep 2 over tp 2 stays inside each replica; ep 4 over tp 2 x dp 2 joins both
    replicas (one domain: a reproduced step is unresolved, as with dp = 1)."""
    assert replica_domains(1, 1, 4) == [[0], [1], [2], [3]]
    assert replica_domains(2, 2, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tp 2 x pp 2 x dp 2
    assert replica_domains(1, 1, 4, ep=2) == [[0, 1], [2, 3]]
    assert replica_domains(2, 1, 2, ep=2) == [[0, 1], [2, 3]]
    assert replica_domains(2, 1, 2, ep=4) == [[0, 1, 2, 3]]
    assert replica_domains(1, 2, 4, ep=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # pp 2: by stage
    # ep 2 over dp 4: a transient fault on rank 2 changes its EP peer 3 too (one domain, a
    # fault); rounding on ranks 1 and 2 is two domains (non-determinism)
    domains = replica_domains(1, 1, 4, ep=2)
    assert not nondeterministic([2, 3], domains) and nondeterministic([2, 3], [[0], [1], [2], [3]])
    assert nondeterministic([1, 2], domains)
    # domain 1 (ranks 2, 3) recomputes domain 0's data: rank 2 holds rank 0's experts and is
    # fed the same tokens, so its local gradient (experts included) is rank 0's; a persistent
    # fault in rank 2's experts reaches rank 3 through the exchange, and both are named
    ok = [[2.0, 1.0, 0.0], [2.5, 3.0, 0.0], [2.2, 1.5, 0.0], [2.7, 3.5, 0.0]]
    assert cross_replica_verdict(ok, [ok[2], ok[3], ok[0], ok[1]], domains, 0) == []
    nan = [math.nan, math.nan, 0.0]
    assert cross_replica_verdict([*ok[:2], nan, nan], [ok[2], ok[3], nan, nan],
                                 domains, 0) == [2, 3]


def test_flip_bit_flips_one_bit_and_back():
    x = torch.ones(4)
    flip_bit(x, 2, 30)
    assert math.isinf(x[2].item()) and x[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0]
    flip_bit(x, 2, 30)
    assert x.tolist() == [1.0] * 4
    flip_bit(x, 0, 31)  # the sign bit
    assert x[0].item() == -1.0


def test_the_drill_spec_parses_with_defaults():
    assert parse_inject("rank=1, step=3") == InjectSpec(rank=1, step=3)
    assert parse_inject("rank:1/step:3") == InjectSpec(rank=1, step=3)
    spec = parse_inject("rank=0,step=2,target=grad,kind=persistent,tensor=x,index=5,bit=3")
    assert (spec.target, spec.kind, spec.tensor, spec.index, spec.bit) == \
        ("grad", "persistent", "x", 5, 3)


@pytest.mark.parametrize("overrides, key", [
    (["resilience.spike_factor=1.0"], "resilience.spike_factor"),
    (["resilience.spike_factor=0.5"], "resilience.spike_factor"),
    (["resilience.rerun=on_spike"], "resilience.spike_warmup"),
    (["resilience.rerun=always"], "resilience.rerun"),
    (["resilience.rerun=on_spike", "resilience.spike_warmup=0"], "resilience.spike_warmup"),
    (["resilience.rerun_tolerance=-1"], "resilience.rerun_tolerance"),
    (["resilience.inject='rank=1,step=2'"], "resilience.inject"),  # not enabled
    (["resilience.inject='rank=1'", "resilience.allow_inject=true"], "resilience.inject"),
    (["resilience.inject='rank=1,step=2,target=optimizer'", "resilience.allow_inject=true"],
     "resilience.inject"),
])
def test_bad_rerun_and_inject_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        check_sections(load_config(overrides))


@pytest.mark.parametrize("inject, what", [
    ("rank=1,step=301", "beyond train.max_steps=300"),
    ("rank=2,step=3", "world has 2 ranks"),
])
def test_a_drill_the_run_cannot_reach_is_refused_before_launch(inject, what):
    cfg = load_config([f"resilience.inject='{inject}'", "resilience.allow_inject=true",
                       "train.max_steps=300"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=") as e:
        validate(cfg, 2)
    assert what in str(e.value)
    cfg = load_config(["resilience.inject='rank=1,step=300'", "resilience.allow_inject=true",
                       "train.max_steps=300", "resilience.rerun=on_spike",
                       "resilience.spike_warmup=10"])
    validate(cfg, 2)  # the last step is a step the run reaches


def test_an_overflow_the_loss_scale_absorbs_is_not_suspicious():
    """fp16: a non-finite norm while the dynamic scale can still shrink is the scale's to
    absorb (no rerun); at the scale's floor it is suspicious."""
    from types import SimpleNamespace

    from megalite.config.sections import ResilienceConfig
    from megalite.resilience.rerun import RerunAttribution
    from megalite.train.loss_scale import LossScaler

    scaler = LossScaler(scale=1024.0, min_scale=1.0)
    engine = SimpleNamespace(grad_launching=[])
    rerun = RerunAttribution(ResilienceConfig(rerun="on_nan"), topo=None,
                             device=torch.device("cpu"), engine=engine, rng=None,
                             run_dir=Path("."), loss_scaler=scaler)
    assert engine.grad_launching == [rerun._add_local_grad]
    called = []
    rerun._rerun = lambda *args: called.append(args) or True
    inf, loss = torch.tensor(math.inf), torch.tensor(2.0)
    assert rerun.judge(3, loss, inf, [], [], None) is False and not called
    assert rerun.judge(3, loss, torch.tensor(1.0), [], [], None) is False and not called
    scaler.scale = scaler.min_scale  # at the floor: the run itself is non-finite
    assert rerun.judge(3, loss, inf, [], [], None) is True and len(called) == 1
    assert rerun.detector.recorded == 1  # only the finite step entered the statistics


@pytest.mark.parametrize("overrides, what", [
    (["precision=bf16", "resilience.inject=rank:1/step:3/bit:30"],
     "bit=30 is outside the 16-bit elements of the bf16 parameters: use a bit < 16"),
    (["pp=2", "resilience.inject=rank:1/step:3"],  # the default tensor: block 0's ln_1
     "rank 1 holds no parameter transformer.h.0.ln_1.weight"),
    (["tp=2", "resilience.inject=rank:1/step:3/tensor:transformer.h.1.mlp.c_fc.weight/"
      "index:32768"], "has 32768 elements: use an index < 32768"),  # its TP shard: 512 x 128 / 2
    (["resilience.inject=rank:0/step:3/target:grad/bit:32"], "32-bit elements of the fp32"),
    (["model.arch=mixtral", "model.n_inner=32", "model.moe.num_experts=4", "ep=2",
      "resilience.inject=rank:1/step:3/tensor:model.layers.0.mlp.experts."
      "gate_up_proj/index:16384"], "has 16384 elements: use an index < 16384"),  # E/ep experts
])
def test_a_drill_outside_the_rank_s_tensor_is_refused_before_launch(overrides, what):
    """A drill the rank could not apply (a bit beyond the element's width, a tensor of another
    pipeline stage, an element beyond the rank's TP shard or its EP rank's experts) is refused
    by the launch's checks, naming the key: not by a crash of that rank at the drill's step."""
    cfg = load_config([*overrides, "resilience.allow_inject=true", "train.max_steps=5"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=") as e:
        _launch_checks(cfg, 2)
    assert what in str(e.value)
    fixed = [o.replace("/bit:30", "").replace("/bit:32", "").replace("index:32768", "index:0")
             .replace("index:16384", "index:0") for o in overrides]
    if "pp=2" not in overrides:  # the same drill within the rank's tensor is accepted
        _launch_checks(load_config([*fixed, "resilience.allow_inject=true",
                                    "train.max_steps=5"]), 2)


def _launch_checks(cfg, world: int) -> None:
    """What the preflight checks of a drill: the configuration for the world
    (`validate`), then the drill's tensor on its rank's stage (`check_inject_target`)."""
    validate(cfg, world)
    check_inject_target(cfg, Layout.from_config(cfg, world))


@pytest.mark.parametrize("tensor, held", [
    ("transformer.h.4.attn.c_attn.weight", True), ("transformer.h.5.mlp.c_proj.bias", True),
    ("transformer.h.6.ln_1.weight", False), ("transformer.h.1.ln_1.weight", False),
    ("transformer.ln_f.weight", False), ("transformer.wte.weight", False),
])
def test_a_zb_v_drill_is_checked_against_the_blocks_of_the_v(tensor, held):
    """zb-v at pp=2 with 8 blocks: rank 1 holds slices 1 and 2 of the V (blocks 2-3 and 4-5),
    rank 0 slices 0 and 3 (blocks 0-1 and 6-7, the embeddings, ln_f and the head). A drill
    on rank 1 is accepted for a tensor of its blocks and refused, naming the key, for one of
    rank 0's."""
    cfg = load_config(["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2",
                       "model.n_layer=8", f"resilience.inject=rank:1/step:3/tensor:{tensor}",
                       "resilience.allow_inject=true", "train.max_steps=5"])
    if held:
        _launch_checks(cfg, 2)
        return
    with pytest.raises(ConfigError, match=rf"^resilience\.inject=.*rank 1 holds no parameter "
                       rf"{tensor}"):
        _launch_checks(cfg, 2)


def test_a_parameter_drill_under_zero3_is_refused_before_launch():
    cfg = load_config(["resilience.inject=rank:0/step:1", "resilience.allow_inject=true",
                       "zero=3"])
    with pytest.raises(ConfigError, match=r"^resilience\.inject=.*zero=3"):
        validate(cfg, 2)
    validate(load_config(["resilience.inject=rank:0/step:1/target:grad",
                          "resilience.allow_inject=true", "zero=3"]), 2)


def test_a_batch_skipped_as_bad_data_is_no_good_step_for_the_loss_scale():
    """fp16: the dynamic scale grows after `window` good steps in a row; a finite step that
    resilience.rerun skipped as bad data is not one of them (nor an overflow)."""
    from megalite.checkpoint.state import Progress
    from megalite.config.train_section import TrainConfig
    from megalite.train.loss_scale import LossScaler
    from megalite.train.step_guard import StepGuard

    scaler = LossScaler(scale=1024.0, min_scale=1.0, window=2)
    guard = StepGuard(None, None, None, Progress(step=1), TrainConfig(max_bad_steps=5),
                      loss_scaler=scaler)
    guard.count_skipped(finite=True)
    guard.count_skipped(finite=True, data_skip=True)
    assert (scaler.scale, scaler.good_steps) == (1024.0, 1)
    assert (guard.progress.skipped_steps, guard.bad_in_a_row) == (1, 1)
    guard.count_skipped(finite=True)  # the second good step: the scale grows
    assert (scaler.scale, scaler.good_steps, guard.bad_in_a_row) == (2048.0, 0, 0)


def test_a_run_dir_with_a_fault_verdict_is_refused_at_start(tmp_path, capsys):
    """scripts/pretrain.py's first check (`refuse_after_fault`): while
    <run dir>/resilience/fault.json exists the process exits with HARDWARE_FAULT_EXIT, naming
    the file, the fault and how to clear it; once moved aside it starts."""
    from megalite.cli.fault_exit import refuse_after_fault
    from megalite.resilience.faults import write_fault

    refuse_after_fault(tmp_path)  # no verdict: nothing happens
    path = write_fault(tmp_path, {"step": 5, "kind": "transient", "rank": 3, "node": "gpu08",
                                  "gpu": 2})
    with pytest.raises(SystemExit) as e:
        refuse_after_fault(tmp_path)
    assert e.value.code == HARDWARE_FAULT_EXIT
    message = capsys.readouterr().err
    assert f"{path} exists" in message and "rank 3 (node gpu08, GPU 2)" in message, message
    assert f"mv {path} " in message
    path.rename(path.with_name("fault-cleared.json"))
    refuse_after_fault(tmp_path)


def test_rerun_deterministic_switches_a_cuda_run_to_deterministic_algorithms(monkeypatch):
    """resilience.rerun_deterministic's switch (`use_deterministic_kernels`): on a CUDA device
    torch's deterministic algorithms (warn-only), no filling of uninitialised memory; nothing
    on a CPU (its kernels are deterministic). cuBLAS's fixed workspace is set at launch
    (`cublas_workspace_env`, from init_runtime) with rerun on, unless the user set it."""
    from types import SimpleNamespace

    from megalite.resilience.deterministic import (
        cublas_workspace_env,
        use_deterministic_kernels,
    )

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cublas_workspace_env(SimpleNamespace(rerun="off", rerun_deterministic=True))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's stays
    cublas_workspace_env(SimpleNamespace(rerun="on_nan", rerun_deterministic=True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    cublas_workspace_env(SimpleNamespace(rerun="on_nan", rerun_deterministic=True))
    fill = torch.utils.deterministic.fill_uninitialized_memory
    assert not use_deterministic_kernels(torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert use_deterministic_kernels(torch.device("cuda"))  # sets flags only: no GPU needed
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.utils.deterministic.fill_uninitialized_memory is False
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
