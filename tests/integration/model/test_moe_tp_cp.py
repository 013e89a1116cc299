"""MoE under tensor, sequence and context parallelism equals the serial run (fp32, dropout 0,
the aux loss, z-loss and aux-loss-free bias on): losses, grad norms, parameters at 1e-5, the
per-layer figures (aux, z-loss, imbalance, dropped, bias range) and every router's bias after
every step (updated from the step's counts). tp2 + SP, cp2 under both CP algorithms (ring with
the sequence aux loss), tp2 · cp2, a Mixtral and a Qwen3-MoE with a gated shared expert (tp2
with a capacity that drops); a checkpoint saved at tp2 · cp2 resumes at cp2 and one saved at
tp2 at tp1, each continuing the serial run (the bias from meta.json). At the layer: under tp2
an expert that receives no token gets a zero gradient, not NaN, and the layer equals the
serial one (outputs, gradients, counts, aux, z-loss and hf pooled values); with FP8 experts at
tp2 + SP and at cp2 every expert's FP8 product takes exactly the serial layer's amaxes."""
from __future__ import annotations

import pytest
import torch

from megalite.config.moe import MoEConfig
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.ledger import RoutingLedger
from megalite.model.moe.tokens import TokenSplit
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from tests.integration.model.test_moe_layouts import MOE, assert_figures_equal
from tests.integration.model.test_qwen3_layouts import QWEN3_MOE
from tests.layouts import (
    assert_equal,
    from_step,
    train_in_process,
    train_layout,
    train_layouts,
)
from tests.moe_layers import copy_pieces, random_serial_layer, serial_and_split, stacked_piece

pytestmark = pytest.mark.distributed

STEPS = 3
SHARED = ["model.moe.shared_experts=1", "model.moe.shared_expert_gate=true"]
CAPACITY = ["model.moe.capacity_factor=1.0", "model.moe.drop_policy=position"]
SEQUENCE = ["model.moe.aux_loss=sequence"]
TP, CP, RING = ["tp=2", "sp=true"], ["cp=2"], ["cp=2", "parallel.cp_comm=ring"]
# lr 2e-3 (the DP test's 1e-2 here): AdamW turns the rounding differences of the few
# embedding rows whose gradient is near 0 into updates of lr · relative error (as in a dense
# tp2 run, ~1e-6 at 1e-2 with the routing's extra sums)
LR = ["optim.lr=2e-3"]


def _resumed(serial: dict, step: int) -> dict:
    return {**from_step(serial, step), "moe": serial["moe"][step:],
            "moe_bias": serial["moe_bias"][step:]}


def _assert_same(serial: dict, ranks: list) -> None:
    """assert_equal, the per-layer figures, and every router's bias after every step (exact:
    the same signs of the same counts)."""
    assert_equal(serial, ranks)
    assert_figures_equal(serial, ranks)
    assert any(v != 0 for step in serial["moe_bias"] for b in step.values() for v in b)
    for res in ranks:
        assert res["moe_bias"] == serial["moe_bias"]


def test_tp_sp_cp_equal_serial_and_resume_across_layouts(tiny_data, tmp_path):
    mixtral = [f"data.dir={tiny_data}", *MOE, *LR]
    qwen = [f"data.dir={tiny_data}", *QWEN3_MOE, *SHARED, *LR]
    serial = {"mixtral": train_in_process(tmp_path / "s1", mixtral, STEPS),
              "sequence": train_in_process(tmp_path / "s2", mixtral + SEQUENCE, STEPS),
              "qwen": train_in_process(tmp_path / "s3", qwen, STEPS),
              "capacity": train_in_process(tmp_path / "s4", qwen + CAPACITY, STEPS)}
    assert 0 < serial["capacity"]["moe"][0]["1"]["dropped"] < 1
    at_4, at_2 = tmp_path / "ckpt4", tmp_path / "ckpt2"
    four = [("mixtral", mixtral + TP + CP + [f"checkpoint.dir={at_4}"]), ("qwen", qwen + TP + CP)]
    results = train_layouts(tmp_path / "w4", 4, [run for _, run in four], STEPS, save_at=1)
    two = [("mixtral", mixtral + TP + [f"checkpoint.dir={at_2}"]), ("mixtral", mixtral + CP),
           ("sequence", mixtral + SEQUENCE + RING), ("capacity", qwen + CAPACITY + TP)]
    results += train_layouts(tmp_path / "w2", 2, [run for _, run in two], STEPS, save_at=1)
    for (name, _), ranks in zip(four + two, results):
        _assert_same(serial[name], ranks)
    expected = _resumed(serial["mixtral"], 1)
    resumed_cp = train_layout(tmp_path / "r2", 2, mixtral + CP + [
        f"checkpoint.resume={at_4 / 'step_00000001'}"], STEPS - 1)
    resumed_tp1 = train_in_process(tmp_path / "r1", mixtral + [
        f"checkpoint.resume={at_2 / 'step_00000001'}"], STEPS - 1)
    for ranks in (resumed_cp, [resumed_tp1]):
        _assert_same(expected, ranks)


def test_an_expert_without_tokens_under_tp2_has_a_zero_gradient():
    """At the layer, under each aux loss (layer, sequence, hf): outputs, gradients and the
    figures (counts, aux, z-loss, the pooled value; the TP ranks' parts summed) equal the
    serial layer's, and expert 3, which no token picks, has a zero gradient, not NaN."""
    for per_mode in run_ranks(_empty_expert, 2):
        for aux_loss, (y, y_tp, grads, figures, figures_tp) in per_mode.items():
            torch.testing.assert_close(y_tp, y, rtol=1e-5, atol=1e-6)
            for name, (g, g_tp) in grads.items():
                assert torch.isfinite(g_tp).all(), (aux_loss, name)
                torch.testing.assert_close(g_tp, g, rtol=1e-5, atol=1e-6,
                                           msg=f"{aux_loss} {name}")
            assert (grads["experts.gate_up_proj"][1][3] == 0).all()
            assert (grads["experts.down_proj"][1][3] == 0).all()
            counts = figures["counts"]
            assert counts[0, 3] == 0 and counts[0].sum() == 32
            for key, value in figures.items():
                torch.testing.assert_close(figures_tp[key], value, rtol=1e-6, atol=0,
                                           msg=f"{aux_loss} {key}")


SPLITS = {"experts.gate_up_proj": (1, 2), "experts.down_proj": (2, 1),
          "shared_experts.gate_up_proj.weight": (0, 2), "shared_experts.down_proj.weight": (1, 1)}


def _shard(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """TP rank `rank`'s piece of a layer's parameter (or gradient) `full`: the split dim cut
    into `blocks` stacked blocks, each split over the ranks (ParamSpec's rule)."""
    if name not in SPLITS:
        return full
    return stacked_piece(full, *SPLITS[name], rank, world)


def _empty_expert(rank, world):
    """Rank function: one MoE layer (the aux loss of each mode and the z-loss on, a gated
    shared expert) serially and at tp2 + SP, on 16 tokens whose router never picks expert 3:
    per mode, this rank's outputs, each parameter's gradient (serial: this rank's piece; the
    replicated ones summed over TP, as the engine sums them under SP) and the figures (the
    TP ranks' parts summed)."""
    topo = build_topology(world, 1, 1, rank=rank)
    out = {}
    for aux_loss in ("layer", "sequence", "hf"):
        moe = MoEConfig(num_experts=4, top_k=2, aux_loss=aux_loss, aux_loss_coeff=0.1,
                        z_loss_coeff=0.01, shared_experts=1, shared_expert_gate=True)
        serial = random_serial_layer(moe, 8, 16)
        with torch.no_grad():
            serial.gate.weight[3] = -5.0  # x > 0: expert 3's logit far below the others'
        layer = MoELayer(moe, 8, 16, 0, RoutingLedger(moe, [0]), world,
                         TokenSplit.of(topo.tp_group, True, None))
        x = torch.rand(8, 2, 8, generator=torch.Generator().manual_seed(1)) + 0.1
        out[aux_loss] = serial_and_split(
            serial, layer, x, lambda name, full: _shard(name, full, rank, world), SPLITS,
            ("counts", "aux", "z", "pooled"), rank, world)
    return out


def test_fp8_experts_scale_each_expert_as_the_serial_layer_under_tp2_and_cp2():
    """FP8 tensorwise experts at the layer (the aux loss and z-loss on): at tp2 + SP (each
    expert's weights split, its tokens gathered) and at cp2 (each rank other tokens) every
    FP8 product every expert runs, forward and backward, takes exactly the serial layer's
    two amaxes (so scales): the per-expert amaxes reduced over the ranks whose pieces the
    serial tensor spans. Each CP rank holds tokens of every expert, so the products line up."""
    for per_layout in run_ranks(_fp8_scales, 2):
        for layout, (serial, parallel) in per_layout.items():
            assert len(serial) == 4 * (2 + 4), layout  # 4 experts x 2 forward, 4 backward
            assert parallel == serial, layout


def _fp8_scales(rank, world):
    """Rank function: one MoE layer with FP8 experts serially and at tp2 + SP and cp2 (this
    rank's tokens): per layout, the amaxes of each FP8 product's operands in launch order,
    the serial layer's and this rank's. The output's gradient is a given one (that of
    y · g): a gradient of y itself would differ from serial's by the rounding of the TP
    ranks' partial outputs' sum, and its amax with it."""
    import megalite.model.moe.fp8_experts as fp8_experts

    topos = {"tp": build_topology(world, 1, 1, rank=rank),
             "cp": build_topology(1, 1, 1, rank=rank, cp=world)}
    splits = {"tp": TokenSplit.of(topos["tp"].tp_group, True, None),
              "cp": TokenSplit.of(None, False, topos["cp"].cp_group)}
    moe = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    seen, product = [], fp8_experts.scaled_product

    def recorded(a, b, dtypes, layer, groups, out_dtype, amaxes):
        seen.append([amax.item() for amax in amaxes])
        return product(a, b, dtypes, layer, groups, out_dtype, amaxes)

    fp8_experts.scaled_product = recorded
    x, g = torch.randn(2, 16, 2, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for layout, split in splits.items():
        serial = random_serial_layer(moe, 16, 32)
        tp = split.tp_size
        layer = MoELayer(moe, 16, 32, 0, RoutingLedger(moe, [0]), tp, split)
        copy_pieces(layer, serial, lambda name, full: _shard(name, full, rank if tp > 1 else 0,
                                                             tp))
        runs = []
        for module, inputs, grad in ((serial, x, g),
                                     (layer, x.chunk(world)[rank], g.chunk(world)[rank])):
            module.experts.fp8 = "tensorwise"
            seen.clear()
            module.ledger.open(True)
            y = module(inputs)
            ((y * grad).sum() + module.ledger.close()).backward()
            runs.append(list(seen))
        out[layout] = runs
    fp8_experts.scaled_product = product
    return out
