"""`megalite-bench moe` (megalite_bench/moe.py) at a minimal size on the CPU: every arm runs
and is timed, the ratios are those arms' speeds, the dense model has the MoE's active
parameters but the router's, grouped GEMM equals the loop before it is timed (and a
difference stops the benchmark), and the JSON holds what the table prints."""
from __future__ import annotations

import json

import pytest

from megalite_bench import moe, moe_arms
from megalite_bench.cli import main

# a one-block Mixtral small enough for a few seconds: 64 wide, 8 experts of 32, top-2
TINY = ["--model", "n_layer=1", "n_embd=64", "n_head=2", "n_kv_head=1", "vocab_size=256",
        "n_inner=32", "--seq-len", "16", "--micro-batch", "2", "--layer-tokens", "32",
        "--steps", "1", "--warmup", "1", "--repeats", "2"]
ARMS = {"megalite dense", "megalite moe grouped", "megalite moe loop", "transformers eager",
        "transformers grouped_mm"}


def test_the_benchmark_runs_every_arm_and_writes_its_table_as_json(tmp_path, capsys):
    main(["moe", *TINY, "--device", "cpu", "--out", str(tmp_path / "moe.json")])
    got = json.loads((tmp_path / "moe.json").read_text())
    assert got["auto"] == "grouped" and got["not_run"] == {}  # auto on a CPU: grouped GEMM
    arms = got["step"]["arms"]
    assert set(arms) == ARMS
    assert all(a["s"] > 0 and a["per_s"] == pytest.approx(2 * 16 / a["s"]) for a in arms.values())
    ratios = got["step"]["ratios"]
    assert set(ratios) == {name for name, _, _ in moe.step_ratios("grouped")}
    speed = {n: a["per_s"] for n, a in arms.items()}
    for name, num, den in moe.step_ratios("grouped"):  # rounds' medians: within their range
        assert ratios[name]["min"] <= ratios[name]["median"] <= ratios[name]["max"]
        assert ratios[name]["min"] > 0
    assert ratios["moe / dense (megalite)"]["median"] == pytest.approx(
        speed["megalite moe grouped"] / speed["megalite dense"], rel=0.5)
    layer = got["layer"]
    assert layer["dtype"] == "float32" and layer["max_rel_difference"] <= 1e-5
    assert set(layer["arms"]) == {"grouped", "loop"} and "grouped / loop" in layer["ratios"]
    p = got["params"]  # the dense MLP is top_k experts wide: active = dense + the router
    assert p["moe_active"] - p["dense"] == 1 * 8 * 64 and p["moe_total"] > p["moe_active"]
    assert got["load_before"] >= 0 and got["threads"] >= 1
    out = capsys.readouterr().out
    for name in [*ARMS, *ratios, "load average"]:
        assert name in out


def test_a_grouped_gemm_that_differs_from_the_loop_stops_before_timing(monkeypatch):
    timed = []
    monkeypatch.setattr(moe, "layer_pair", lambda *a: ({"grouped": lambda: None,
                                                        "loop": lambda: None}, 1e-3))
    monkeypatch.setattr(moe, "_rounds", lambda *a: timed.append(a) or [])
    args = _args(["--reference", "0"])
    with pytest.raises(AssertionError, match="differ"):
        moe.measure_layer(args, moe_arms.torch.device("cpu"), moe_arms.torch.float32)
    assert not timed


def test_a_layer_grouped_gemm_cannot_take_is_refused_by_name():
    import torch

    args = _args(["--model", "n_embd=64", "n_head=2", "n_inner=30"])  # 30 fp32: not aligned
    with pytest.raises(ValueError, match="does not take this layer"):
        moe_arms.layer_pair(moe_arms.model_configs(args)[0], torch.device("cpu"),
                            torch.float32, 8)


def _args(extra):
    import argparse

    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    return parser.parse_args([*TINY, *extra])
