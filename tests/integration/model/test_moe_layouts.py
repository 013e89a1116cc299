"""A Mixtral with the aux loss, the z-loss and the aux-loss-free bias on trains alike under
data parallelism with ZeRO 0-3 as serially (losses, grad norms, parameters at 1e-5, the
per-layer figures — aux, z-loss, imbalance, bias range — and so the bias, whose update reads
the step's counts summed over DP); the logged loss is the cross-entropy alone (the first
step's loss does not move with the aux coefficient, its gradient does); metrics.jsonl holds
the per-layer figures."""
from __future__ import annotations

import json
import math

import pytest

from megalite.checkpoint.export import ExportError, export_hf, load_model
from megalite.config.layout import validate
from megalite.train.build import build_trainer
from megalite.train.runtime import init_runtime
from tests.layouts import (
    assert_equal,
    composed,
    from_step,
    train_in_process,
    train_layouts,
)

MOE = ["model.arch=mixtral", "model.n_kv_head=2", "model.n_inner=32", "model.rope_theta=50000",
       "model.tie_word_embeddings=false", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
       "model.moe.bias_update_rate=0.01", "optim.lr=1e-2"]
STEPS = 3

pytestmark = pytest.mark.distributed


def _common(tiny_data):
    return [f"data.dir={tiny_data}", *MOE]


def assert_figures_equal(serial, ranks, rel=1e-5):
    for res in ranks:
        for ours, theirs in zip(serial["moe"], res["moe"]):
            assert ours.keys() == theirs.keys()
            for layer, figures in ours.items():
                for key, value in figures.items():
                    assert math.isclose(value, theirs[layer][key], rel_tol=rel,
                                        abs_tol=1e-7), (layer, key, value, theirs[layer][key])


# the serial axes MoE runs with beside the plain run: a tied head, the document mask (with
# positions reset, EOS targets left out) and a ramped-up batch; bf16
OTHER = ["model.tie_word_embeddings=true", "train.attention_mask=document",
         "train.reset_positions=true", "train.eos_loss=false", "train.rampup_batch_size=[8,8,16]"]
BF16 = ["precision=bf16"]
RESILIENCE_ON = ["resilience.check_every=1", "resilience.straggler_report_every=1",
                 "resilience.hang_dump=true"]


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    return train_in_process(tmp_path_factory.mktemp("serial"), _common(tiny_data), STEPS)


@pytest.fixture(scope="module")
def serial_other(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("serial-other")
    return {"other": train_in_process(root / "o", _common(tiny_data) + OTHER, STEPS),
            "bf16": train_in_process(root / "b", _common(tiny_data) + BF16, STEPS)}


def test_dp_with_zero_0_to_3_equals_serial_and_resumes_with_the_bias(tiny_data, tmp_path,
                                                                     serial, serial_other):
    """dp 2 under ZeRO 0-3 (and with optimizer offload and the resilience defaults on; with a
    tied head, the document mask and a ramped-up batch) equals its serial run; bf16 within
    the combination matrix's bf16 bounds. The ZeRO-3 run's checkpoint after step 1, resumed
    serially, continues the serial run (the bias restored from meta.json)."""
    common = _common(tiny_data)
    figures = serial["moe"][-1]
    assert set(figures) == {"0", "1"} and figures["0"]["bias_max"] > 0 > figures["0"]["bias_min"]
    ckpt = tmp_path / "ckpt"
    runs = {"zero0": (serial, common + ["zero=0"]), "zero1": (serial, common + ["zero=1"]),
            "zero2": (serial, common + ["zero=2"]),
            "zero3": (serial, common + ["zero=3", f"checkpoint.dir={ckpt}"]),
            "offload": (serial, common + ["zero=1", "offload.optimizer=0.5", *RESILIENCE_ON]),
            "other": (serial_other["other"], common + OTHER + ["zero=2"]),
            "bf16": (serial_other["bf16"], common + BF16 + ["zero=1"])}
    results = train_layouts(tmp_path, 2, [run for _, run in runs.values()], STEPS, save_at=1)
    for (name, (reference, _)), ranks in zip(runs.items(), results):
        if name == "bf16":
            for res in ranks:
                for a, b, c, d in zip(reference["losses"], res["losses"], reference["norms"],
                                      res["norms"]):
                    assert math.isclose(a, b, rel_tol=3e-3) and math.isclose(c, d, rel_tol=5e-2)
            continue
        assert_equal(reference, ranks)
        assert_figures_equal(reference, ranks)
    with pytest.raises(ExportError, match="model.moe.bias_update_rate=0.01: "):
        export_hf(ckpt / "step_00000001", tmp_path / "hf")  # MixtralForCausalLM has no bias
    assert not (tmp_path / "hf").exists()
    resumed = train_in_process(tmp_path / "r", common + [
        f"checkpoint.resume={ckpt / 'step_00000001'}"], STEPS - 1)
    expected = {**from_step(serial, 1), "moe": serial["moe"][1:]}
    assert_equal(expected, [resumed])
    assert_figures_equal(expected, [resumed])


def test_logged_loss_is_the_cross_entropy_and_figures_are_logged(tiny_data, tmp_path, serial):
    """The aux coefficient 100x: the first step's loss (before any update) unchanged, its grad
    norm not; metrics.jsonl's line carries the figures of every MoE layer and the header the
    total and active parameters."""
    overrides = _common(tiny_data) + ["model.moe.aux_loss_coeff=1.0",
                                      "model.moe.z_loss_coeff=0.1", "train.max_steps=1"]
    cfg = composed(overrides)
    validate(cfg, 1)
    (record,) = build_trainer(cfg, init_runtime(cfg), tmp_path).fit()
    assert record["loss"] == serial["losses"][0]
    assert abs(record["grad_norm"] - serial["norms"][0]) > 1e-4 * serial["norms"][0]
    assert set(record["moe"]) == {"0", "1"}
    assert set(record["moe"]["1"]) == {"aux", "z_loss", "imbalance", "dropped", "bias_min",
                                       "bias_max"}
    assert record["moe"]["1"]["imbalance"] >= 1.0 and record["moe"]["1"]["dropped"] == 0
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    header = logged[0]["run"]
    assert header["parameters"] > header["active_parameters"] > 0
    assert logged[-1]["moe"] == record["moe"]


def test_megalite_export_of_a_checkpoint_loads_in_transformers(tiny_data, tmp_path):
    """A Mixtral checkpoint (no bias) through megalite-export's streamed writer: the weights
    bitwise, MixtralForCausalLM's logits equal to the checkpoint's model's."""
    import torch
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    ckpt = tmp_path / "ckpt"
    overrides = [o for o in _common(tiny_data) if "bias_update_rate" not in o]
    train_in_process(tmp_path / "run", overrides + [f"checkpoint.dir={ckpt}"], 1, save_at=1)
    step = ckpt / "step_00000001"
    export_hf(step, tmp_path / "hf")
    ours = load_model(step).eval()
    written = load_file(tmp_path / "hf" / "model.safetensors")
    for name, p in ours.named_parameters():
        spec = ours.param_specs[name]
        assert torch.equal(written[spec.name], spec.unshard([p.detach()])), name
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager")
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf.eval()(ids).logits).abs().max().item() <= 1e-5
