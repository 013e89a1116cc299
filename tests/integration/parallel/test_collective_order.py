"""One collective order on every rank, whatever each host's speed (NCCL's rule across
communicators, `megalite.testing.collective_order`): every async path megalite has — ZeRO 1/2/3
with and without optimizer offload, overlap_param_gather, CP's all-gather and ring, TP + SP,
the pipeline's schedules, FP8's amax reductions, activation offload, MoE under TP + SP and CP
(its FP8 experts' amaxes too) and its routing figures under pipeline parallelism, expert
parallelism's token exchange and FP8 experts' amaxes — trained on real gloo ranks with one
rank's host slowed (its offload worker's tasks and its forward), each rank's launches recorded
by the probe, and every two ranks' shared launches in the same order."""
from __future__ import annotations

import time

import pytest

from megalite.config.layout import validate
from megalite.testing.collective_order import OrderProbe, order_mismatches
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.integration.model.test_moe_layouts import MOE
from tests.layouts import composed

SLOW_S = 0.02  # the slowed rank's delay before each host task (20 ms, as the issue found it)


def _slow_host(trainer, seconds: float) -> None:
    """This rank's host made slow: every offload worker task and every sharding unit's
    forward start late by `seconds` (patched inside the rank: the library has no such flag)."""
    offload = trainer.engine.offload
    if offload is not None:
        submit = offload.worker.submit

        def late(fn, *args):
            def run(*a):
                time.sleep(seconds)
                return fn(*a)
            return submit(run, *args)
        offload.worker.submit = late
    for chunk in trainer.model.chunks:
        for unit in chunk.sharding_units():
            unit.register_forward_pre_hook(lambda *_: time.sleep(seconds / 10))


def _probed(rank, world, configs, run_dir, steps, slow_rank):
    sequences = []
    for i, cfg in enumerate(configs):
        validate(cfg, world)
        trainer = build_trainer(cfg, init_runtime(cfg), f"{run_dir}/{i}")
        probe = OrderProbe.install(trainer.topo.counter)
        if rank == slow_rank:
            _slow_host(trainer, SLOW_S)
        for _ in range(steps):
            trainer.train_step()
        trainer.engine.wait_for_params()
        sequences.append(probe.launched)
    return sequences


def _run(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=1", "train.global_batch_size=4",
            "model.n_layer=4",
            "parallel.bucket_mb=0.01", *extra]


FP8 = ["fp8.recipe=tensorwise", "fp8.emulate=true"]
# every async path, several layouts per launch of 4 ranks
FOUR_RANKS = [
    # the reproduction (cp 2, zero 1, overlap_param_gather, offload 0.5) at dp 2, FP8
    ["cp=2", "zero=1", "parallel.overlap_param_gather=true", "offload.optimizer=0.5", *FP8],
    ["cp=2", "parallel.cp_comm=ring", "zero=3", "offload.optimizer=0.5",
     "offload.activations=true", "train.attention_mask=document"],
    ["tp=2", "sp=true", "zero=2", "offload.optimizer=0.5", "train.recompute=true", *FP8],
    ["tp=2", "sp=true", "zero=3", "cp=2"],
    ["zero=1", "parallel.overlap_param_gather=true"],
    ["pp=2", "parallel.virtual_stages=2", "zero=1", "parallel.overlap_param_gather=true",
     "offload.optimizer=0.5"],
    ["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "zero=2",
     "offload.optimizer=0.5", "tp=2", "sp=true"],
    ["pp=2", "parallel.schedule=zb-h1", "zero=0", "cp=2", "parallel.cp_comm=ring", *FP8],
    # MoE at pp 2 x dp 2: the routing figures over DP, then over the stages (a chunk without
    # an MoE layer on each stage)
    ["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "zero=1", *MOE,
     "model.moe.first_dense_layers=1"],
    # MoE: the routing's TP gathers and reduce-scatter, the counts' all-reduce over CP, the
    # step's figures over TP then DP x CP, the FP8 experts' per-expert amaxes over TP and CP
    ["model.arch=mixtral", "model.n_kv_head=2", "model.n_inner=32", "model.moe.num_experts=4",
     "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
     "model.moe.bias_update_rate=0.01", "tp=2", "sp=true", "cp=2", "zero=1",
     "offload.optimizer=0.5", *FP8],
    # expert parallelism: the token all-to-alls (and the all-gather dispatch) between the DP
    # x CP reductions, the experts' EDP reductions and the norm's EP sum
    [*MOE, "ep=2", "zero=3", "model.moe.bias_update_rate=0.01"],
    [*MOE, "ep=4", "parallel.ep_dispatch=allgather", "model.moe.shared_experts=1"],
    # each pipeline stage's own EP group (ZB-V's split backward), EP over CP ranks (its FP8
    # experts' amaxes: back to the sources over EP, over CP, to the expert ranks over EP)
    [*MOE, "ep=2", "pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "zero=1"],
    # ZeRO 3 under ZB-H1: a unit's experts' EDP gathers and reduce-scatters in its B, its
    # dense weights' reduce-scatter in the deferred W, freed after both
    [*MOE, "ep=2", "pp=2", "parallel.schedule=zb-h1", "zero=3"],
    [*MOE, "ep=2", "cp=2", "zero=2", "model.moe.bias_update_rate=0.01", *FP8],
    # EP folded over TP: each rank's own SP tokens over EP, the shared expert's TP gather and
    # reduce-scatter, the chosen experts' TP gather for the counts
    [*MOE, "ep=2", "tp=2", "sp=true", "zero=1", "model.moe.shared_experts=1",
     "model.moe.bias_update_rate=0.01"],
]


@pytest.mark.distributed
def test_ranks_launch_in_one_order_with_a_slow_host(tiny_data, tmp_path):
    """2 steps of each of FOUR_RANKS with rank 1's host slowed: every two ranks' shared
    launches in one order (the first layout, before the fix: rank 0 launched its deferred
    DP x CP gathers in a run, rank 1 between the forward's CP gathers)."""
    configs = [composed(_run(tiny_data, *extra)) for extra in FOUR_RANKS]
    for cfg in configs:
        validate(cfg, 4)
    per_rank = run_ranks(_probed, 4, args=(configs, str(tmp_path), 2, 1), timeout_s=600)
    for i, extra in enumerate(FOUR_RANKS):
        sequences = [per_rank[r][i] for r in range(4)]
        assert all(sequences), extra
        problems = order_mismatches(sequences)
        assert not problems, (extra, problems)
        if "ep=2" in extra:  # the probe sees the token exchange
            assert any(op == "all_to_all" and name == "ep" for name, _, op, _ in sequences[0])
