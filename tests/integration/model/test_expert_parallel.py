"""Expert parallelism folded over a stage's data- and context-parallel ranks equals the serial
run (fp32, rel 1e-5):
losses, grad norms, every parameter (each EP rank's experts are its rows of the serial
[E, ...] tensors), the validation loss, the per-layer figures (aux, z-loss, imbalance, the
bias's range) and the step's per-expert counts summed over the stage (what updates the bias)
— at ep 2 over dp 2, ep 4 over dp 4 (EDP = 1) and ep 2 over dp 4 (EDP = 2), ep 2 at pp 2
(1F1B, ZB-V, and ZB-H1 and ZB-V under ZeRO 3; each stage its own EP groups, its counts per
block), ep 2 over cp 2 and ep 4
over cp 2 x dp 2 (each rank dispatching its own CP chunks), ep 2 over tp 2 and ep 4 over
tp 2 x dp 2 with SP (experts whole on each rank, each rank's own tokens), with both
dispatchers, ZeRO 0-3, optimizer offload, a Mixtral and a Qwen3-MoE with a gated shared
expert, init_from a checkpoint, HellaSwag's scores, and routing skewed so that every token
picks experts 0 and 1: one expert takes every token and the EP ranks holding experts 2 and 3
receive no rows at all. A checkpoint written at ep 2 holds the serial experts and resumes at
ep 1, one written at ep 4 resumes at ep 2 and ep 1. The plan's parameters, model-state bytes and
DP / EDP / EP wire bytes per rank match what the runs measure."""
from __future__ import annotations

import math

import pytest
import torch

from megalite.checkpoint.format import read_global_state
from megalite.config.layout import Layout
from megalite.model.moe import step as moe_step
from megalite.model.moe.layer import MoELayer
from megalite.parallel.topology import coords_of
from megalite.plan.memory import make_plan
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.layouts import (
    Prepared,
    assert_equal,
    composed,
    from_step,
    serial_global,
    train_in_process,
    train_layouts,
)
from tests.unit.eval.test_hellaswag import write_hellaswag

pytestmark = pytest.mark.distributed

STEPS = 3
# Qwen3-MoE's blocks (q/k norms) with a Qwen2-MoE-style gated shared expert
SHARED = ["model.arch=qwen3_moe", "model.moe.shared_experts=1", "model.moe.shared_expert_size=16",
          "model.moe.shared_expert_gate=true"]
# 4 blocks, micro-batches of 2 (the pipelined runs': 4 a replica at pp2 x dp2): 1F1B's stage 0
# holds blocks 0-1, ZB-V's blocks 0 and 3
DEEP = ["model.n_layer=4", "train.micro_batch_size=2"]
# EP folded over TP: lr 2e-3 as the MoE TP tests (test_moe_tp_cp: at 1e-2 AdamW turns the
# rounding of the few embedding rows whose gradient is near 0 into updates above 1e-5)
TP_LR = ["optim.lr=2e-3"]
SKEW = (2.0, 1.0, 0.0, 0.0)  # the routers' starting selection bias: experts 0 and 1 always


def _hellaswag(root):
    """Score a made-up HellaSwag file's 8 examples before the first step (every DP rank the
    same number of micro-batches, so the EP ranks exchange in step)."""
    data = write_hellaswag(root / "hellaswag.jsonl")
    return [f"eval.hellaswag={data}", "eval.hellaswag_examples=8", "train.eval_every=1000"]


def _assert_scores(serial, ranks):
    for rank in ranks:
        ours, theirs = rank["hellaswag"], serial["hellaswag"]
        assert torch.equal(ours.counts, theirs.counts)
        torch.testing.assert_close(ours.losses, theirs.losses, rtol=1e-5, atol=1e-5)
        assert (ours.acc, ours.acc_norm) == (theirs.acc, theirs.acc_norm)


def _qwen(overrides):
    return [o for o in overrides if o != "model.arch=mixtral"] + SHARED


def record_counts(trainer):
    """Record the step's per-expert counts summed over the stage (what `update_bias` reads);
    returns the collector, which puts `update_bias` back and gives [step]{block: counts} of
    this rank's MoE layers (a pipeline stage's own)."""
    counts, original = [], moe_step.update_bias
    block = {id(m.gate.e_score_correction_bias): m.index for m in trainer.model.modules()
             if isinstance(m, MoELayer)}

    def recording(bias, layer_counts, rate):
        if not counts or block[id(bias)] in counts[-1]:
            counts.append({})
        counts[-1][block[id(bias)]] = layer_counts.tolist()
        original(bias, layer_counts, rate)

    moe_step.update_bias = recording

    def collect():
        moe_step.update_bias = original
        return counts
    return collect


def skewed(trainer):
    """`record_counts`, with every router's bias starting at SKEW."""
    for m in trainer.model.modules():
        if isinstance(m, MoELayer):
            m.gate.e_score_correction_bias.copy_(torch.tensor(SKEW))
    return record_counts(trainer)


def _assert_counts(serial, ranks):
    for res in ranks:
        assert len(res["extra"]) == len(serial["extra"])
        for ours, theirs in zip(serial["extra"], res["extra"]):
            assert theirs and theirs.keys() <= ours.keys(), (ours, theirs)
            for layer, b in theirs.items():
                assert all(math.isclose(x, y) for x, y in zip(ours[layer], b)), (layer, b)


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    root, common = tmp_path_factory.mktemp("serial-ep"), [f"data.dir={tiny_data}", *MOE]
    scoring = _hellaswag(root)
    moe = train_in_process(root / "m", Prepared(common + [f"checkpoint.dir={root / 'ckpt'}"]
                                                + scoring, record_counts), STEPS, save_at=1)
    start = root / "ckpt" / "step_00000001"  # init_from: its weights, at step 0
    return {"moe": moe, "start": start, "scoring": scoring,
            "init": train_in_process(root / "i", Prepared(common + [f"init_from={start}"],
                                                          record_counts), STEPS),
            "shared": train_in_process(root / "s", Prepared(_qwen(common), record_counts),
                                       STEPS),
            "deep": train_in_process(root / "d", Prepared(common + DEEP, record_counts), STEPS),
            "tp": train_in_process(root / "t", Prepared(common + TP_LR, record_counts), STEPS),
            "skew": train_in_process(root / "k", Prepared(common, skewed), STEPS)}


def _wire(step_comm: dict, group: str) -> float:
    """The step's wire bytes over `group` (the plan's "dp": DP x CP's, dp_cp under cp > 1)."""
    names = ("dp/", "dp_cp/") if group == "dp" else (group + "/",)
    return sum(v["wire_bytes"] for k, v in step_comm.items() if k.startswith(names))


def _assert_plan(overrides, world, ranks):
    """The plan's parameters and model-state bytes per rank (the experts E/ep a rank, their
    states over EDP) and wire bytes per step: the DP reductions (to 5%: the step's figures'
    and losses' sums are not the plan's), the EDP reductions and the all-gather dispatch to
    the byte, the all-to-all's balanced-routing estimate to 25%."""
    cfg = composed(overrides)
    stages = make_plan(cfg, Layout.from_config(cfg, world, "cpu")).stages
    exact = cfg.parallel.ep_dispatch == "allgather"
    for rank, res in enumerate(ranks):
        stage = stages[coords_of(rank, cfg.tp, cfg.pp, cfg.cp).pp_rank]
        assert res["local_numel"] == stage.params
        for kind, got in res["bytes"].items():
            assert got == pytest.approx(stage.bytes[kind], rel=0.01), (overrides, kind)
        for group, rel in (("dp", 0.05), ("edp", 1e-9), ("ep", 1e-9 if exact else 0.25)):
            assert _wire(res["step_comm"], group) == pytest.approx(stage.comm[group], rel=rel), \
                (overrides, group, res["step_comm"], stage.comm)


def _check(serial, runs, results, world):
    for (reference, run), ranks in zip(runs, results):
        assert_equal(reference, ranks)
        assert_figures_equal(reference, ranks)
        _assert_counts(reference, ranks)
        if run.prepare is record_counts:  # (skewed routing: not the plan's balanced one)
            _assert_plan(run.run, world, ranks)
        if any(o.startswith("eval.hellaswag=") for o in run.run):
            _assert_scores(reference, ranks)


def test_ep2_over_dp2_equals_serial_and_resumes_at_ep1(tiny_data, tmp_path, serial):
    """ep 2 at dp 2: both dispatchers, ZeRO 0, 1 and 2 (and the overlapped parameter gather,
    optimizer offload), Qwen3-MoE with a shared expert, skewed routing (EP rank 1 receives
    nothing); the alltoall ZeRO-1 run's checkpoint after step 1 holds the serial run's
    experts and, resumed at ep 1, continues the serial run."""
    common, ckpt = [f"data.dir={tiny_data}", *MOE, "ep=2"], tmp_path / "ckpt"
    skew = serial["skew"]["extra"]
    assert all(c[2] == c[3] == 0 and c[0] > 0 for step in skew for c in step.values()), skew
    runs = [(serial["moe"], Prepared(common + ["zero=1", f"checkpoint.dir={ckpt}"],
                                     record_counts)),
            (serial["moe"], Prepared(common + ["parallel.ep_dispatch=allgather",
                                               *serial["scoring"]], record_counts)),
            (serial["shared"], Prepared(_qwen(common) + ["zero=1"], record_counts)),
            (serial["skew"], Prepared(common, skewed)),
            (serial["moe"], Prepared(common + ["zero=2", "parallel.ep_dispatch=allgather"],
                                     record_counts)),
            (serial["moe"], Prepared(common + ["zero=0", "offload.optimizer=0.5",
                                               "resilience.check_every=1"], record_counts)),
            (serial["skew"], Prepared(common + ["zero=1", "parallel.ep_dispatch=allgather",
                                                "parallel.overlap_param_gather=true"], skewed))]
    _check(serial, runs, train_layouts(tmp_path, 2, [run for _, run in runs], STEPS,
                                       save_at=1), 2)
    # the checkpoint's global tensors (what megalite-export writes): every expert the
    # serial run's after step 1, gathered from both EP ranks' ranges
    written = read_global_state(ckpt / "step_00000001")
    after_first = serial_global(serial["moe"], 0)
    experts = [name for name in written if ".mlp.experts." in name]
    assert len(experts) == 4  # 2 layers x (gate_up_proj, down_proj)
    for name in experts:
        torch.testing.assert_close(written[name], after_first[name], rtol=1e-5, atol=1e-6)
    resumed = train_in_process(tmp_path / "r", [f"data.dir={tiny_data}", *MOE,
                                                f"checkpoint.resume={ckpt / 'step_00000001'}"],
                               STEPS - 1)
    expected = {**from_step(serial["moe"], 1), "moe": serial["moe"]["moe"][1:]}
    assert_equal(expected, [resumed])
    assert_figures_equal(expected, [resumed])


def test_ep4_and_ep2_over_dp4_equal_serial(tiny_data, tmp_path, serial):
    """4 ranks: ep 4 (both dispatchers, ZeRO 0 and 1; skewed: EP ranks 2 and 3 receive
    nothing), ep 2 and ep 4 folded over tp 2 with SP, and ep 2 with EDP 2 (the experts
    reduced and sharded over EDP; the replica check compares them over EDP every step;
    ZeRO 2 starting from a checkpoint's weights, init_from, each EP rank loading its experts;
    ZeRO 3, each block's experts gathered over EDP), ep 2 at pp 2 under 1F1B, ZB-V and, with
    ZeRO 3, ZB-H1 and ZB-V; the ep 4 run's checkpoint resumed at
    ep 2 and ep 1, the ep 2 x tp 2 run's (the replica check every step) at ep 1, tp 1."""
    common, ckpt = [f"data.dir={tiny_data}", *MOE], tmp_path / "ckpt"
    folded = tmp_path / "ckpt-tp"
    runs = [(serial["moe"], Prepared(common + ["ep=4", "zero=1", f"checkpoint.dir={ckpt}"],
                                     record_counts)),
            (serial["moe"], Prepared(common + ["ep=4", "parallel.ep_dispatch=allgather",
                                               *serial["scoring"]], record_counts)),
            (serial["moe"], Prepared(common + ["ep=2", "zero=1", "resilience.check_every=1"],
                                     record_counts)),
            (serial["skew"], Prepared(common + ["ep=4", "zero=1"], skewed)),
            (serial["moe"], Prepared(common + ["ep=2", "zero=3", "parallel.bucket_mb=0.01"],
                                     record_counts)),
            (serial["init"], Prepared(common + ["ep=2", "zero=2", f"init_from={serial['start']}"],
                                      record_counts)),
            # each pipeline stage its own EP groups: ep 2 over a stage's dp 2
            (serial["deep"], Prepared(common + DEEP + ["ep=2", "pp=2", "zero=1"], record_counts)),
            (serial["deep"], Prepared(common + DEEP + [
                "ep=2", "pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2",
                "parallel.ep_dispatch=allgather"], record_counts)),
            # ZeRO 3 under the zero-bubble schedules: a block's experts' gradients come in
            # its B, its other weights' in the deferred W, and another micro-batch's B between
            (serial["deep"], Prepared(common + DEEP + [
                "ep=2", "pp=2", "parallel.schedule=zb-h1", "zero=3", "parallel.bucket_mb=0.01"],
                record_counts)),
            (serial["deep"], Prepared(common + DEEP + [
                "ep=2", "pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "zero=3"],
                record_counts)),
            # under CP each rank dispatches its own chunks: ep 2 over cp 2 (EDP over dp 2),
            # ep 4 over cp 2 x dp 2
            (serial["moe"], Prepared(common + ["ep=2", "cp=2", "zero=1"], record_counts)),
            (serial["moe"], Prepared(common + ["ep=4", "cp=2", "zero=2",
                                               "parallel.ep_dispatch=allgather"], record_counts)),
            # EP folded over TP (expert TP = 1): ep 2 over tp 2 (EDP over dp 2), ep 4 over
            # tp 2 x dp 2, each rank dispatching its own sequence-parallel tokens
            (serial["tp"], Prepared(common + TP_LR + ["ep=2", "tp=2", "sp=true", "zero=1",
                                                      "resilience.check_every=1",
                                                      f"checkpoint.dir={folded}"],
                                    record_counts)),
            (serial["tp"], Prepared(common + TP_LR + ["ep=4", "tp=2", "sp=true",
                                                      "parallel.ep_dispatch=allgather"],
                                    record_counts))]
    _check(serial, runs, train_layouts(tmp_path, 4, [run for _, run in runs], STEPS,
                                       save_at=1), 4)
    # the ep 4 checkpoint after step 1 resumed at ep 2 (ZeRO 2) continues the serial run
    resumed = train_layouts(tmp_path / "r", 2, [common + [
        "ep=2", "zero=2", f"checkpoint.resume={ckpt / 'step_00000001'}"]], STEPS - 1)[0]
    expected = {**from_step(serial["moe"], 1), "moe": serial["moe"]["moe"][1:]}
    assert_equal(expected, resumed)
    assert_figures_equal(expected, resumed)
    # and at ep 1 (serially)
    alone = train_in_process(tmp_path / "r1", common + [
        f"checkpoint.resume={ckpt / 'step_00000001'}"], STEPS - 1)
    assert_equal(expected, [alone])
    assert_figures_equal(expected, [alone])
    # the ep 2 x tp 2 checkpoint (experts whole on each TP rank, each its EP rank's range of
    # the whole tensor) holds the serial experts and resumes at tp 1, ep 1
    written = read_global_state(folded / "step_00000001")
    after_first = serial_global(serial["tp"], 0)
    for name in (name for name in written if ".mlp.experts." in name):
        torch.testing.assert_close(written[name], after_first[name], rtol=1e-5, atol=1e-6)
    resumed = train_in_process(tmp_path / "rt", common + TP_LR + [
        f"checkpoint.resume={folded / 'step_00000001'}"], STEPS - 1)
    expected = {**from_step(serial["tp"], 1), "moe": serial["tp"]["moe"][1:]}
    assert_equal(expected, [resumed])
    assert_figures_equal(expected, [resumed])
