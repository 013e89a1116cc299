"""Device calibration (`scripts/plan.py --calibrate`, megalite/plan/calibrate.py) and the profile file
it writes (megalite/plan/profile_file.py): a 2-rank gloo calibration writes a profile that loads with
sane fields; damaged, truncated, foreign, old and ill-typed files are refused naming the fault."""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from megalite.plan.calibrate import matmul_rates
from megalite.plan.calibrate_links import (
    bus_factor,
    fit_link,
)
from megalite.plan.profile_file import OPS, load_profile
from megalite.testing.spawn import run_ranks

# model shapes of the calibration: h=64, 4h=256, 16 x 2 = 32 tokens
SHAPE_OVERRIDES = ["model.n_embd=64", "model.n_head=4", "train.seq_len=16",
                   "train.micro_batch_size=2"]


def _calibrate_rank(rank: int, world_size: int, path: str):
    """The command on this rank, then the link sweep as if each rank were a node of its own."""
    import torch

    from megalite.cli.plan import main
    from megalite.plan.calibrate import measure_links

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["--calibrate", "--output", path, *SHAPE_OVERRIDES])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), measure_links(1, torch.device("cpu"))


@pytest.mark.distributed
def test_calibrate_two_gloo_ranks_writes_a_profile_that_loads(tmp_path):
    path = tmp_path / "cpu.json"
    results = run_ranks(_calibrate_rank, 2, args=(str(path),), timeout_s=120)
    assert [r[0] for r in results] == [0, 0], results
    assert str(path) in results[0][1] and results[1][1] == ""  # rank 0 writes and prints
    assert os.listdir(tmp_path) == ["cpu.json"]  # no temporary file left behind
    profile = load_profile(path)
    assert profile["gpus_per_node"] == 2 and profile["memory_bytes"] > 0
    assert profile["device"].startswith("cpu")
    assert set(profile["matmul_tflops"]) == {"fp32", "bf16"}
    shapes = {(e["m"], e["n"], e["k"]) for e in profile["matmul_sweep"]}
    assert shapes == {(32, 256, 64), (32, 64, 256)}
    assert profile["matmul_tflops"] == pytest.approx(matmul_rates(profile["matmul_sweep"]))
    sweep = profile["sweep"]
    assert {e["op"] for e in sweep} == set(OPS) and {e["group_size"] for e in sweep} == {2}
    assert len({e["bytes"] for e in sweep}) >= 3  # a few sizes, to fit latency + size / bw
    for e in sweep:
        assert e["bus_gbps"] == pytest.approx(
            e["bytes"] * bus_factor(e["op"], 2) / e["seconds"] / 1e9)
    # the intra-node fit is the sweep's line; a single node: inter_node copied, and said so
    assert profile["links"]["intra_node"] == pytest.approx(fit_link(sweep))
    assert profile["links"]["inter_node"] == profile["links"]["intra_node"]
    assert any("inter_node: not measured" in n for n in profile["notes"])
    assert set(profile["op_links"]["intra_node"]) == set(OPS)  # a fit per collective kind
    block = profile["block_overhead"]  # a real block timed at 2 token counts, the fit's parts
    assert block["tokens"] == [32, 64] and min(block["seconds"]) > 0
    assert block["fixed_s"] >= 0 and block["per_token_s"] >= 0
    # two nodes of one rank: the inter-node groups are measured, intra_node copied, and said so
    links, sweep, notes = results[0][2]
    assert results[1][2][:2] == (links, sweep)  # every rank returns the same
    assert {(e["link"], e["op"], e["group_size"]) for e in sweep} == \
        {("inter_node", op, 2) for op in OPS}
    assert links["inter_node"] == pytest.approx(fit_link(sweep))
    assert links["intra_node"] == links["inter_node"]
    assert any("intra_node: not measured (one rank a node)" in n for n in notes)
