"""The calibration's CUDA measurements (megalite/plan/calibrate_host.py): HBM copy rate,
pinned copies per direction, the host AdamW, and a profile that the planner loads with them
(the block eager: compiling it would cost the GPU session a minute). Skipped without a GPU;
`megalite-bench gpu` runs it (all tests/unit/*/test_cuda*.py). Written against CUDA semantics;
not yet run on a GPU."""
from __future__ import annotations

import pytest
import torch

from megalite.config.schema import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_hbm_and_pinned_copies_are_measured_within_physical_bounds():
    from megalite.plan.calibrate_host import measure_hbm_gbps, measure_host_link

    device = torch.device("cuda")
    hbm = measure_hbm_gbps(device, 1 << 26)
    link = measure_host_link(device, 1 << 24)
    # a copy can be neither free nor faster than any HBM made so far (~10 TB/s)
    assert 10 < hbm < 20_000
    assert 0.5 < link["h2d_gbps"] < 1_000 and 0.5 < link["d2h_gbps"] < 1_000


def test_single_process_calibration_on_cuda_writes_host_figures(tmp_path, monkeypatch):
    from megalite.plan.calibrate import measure_profile
    from megalite.plan.devices import load_profile_file, table_links
    from megalite.plan.profile_file import save_profile

    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    model = ModelConfig(n_layer=1, n_embd=128, n_head=4, n_positions=128, vocab_size=1000,
                        resid_pdrop=0.1)
    links = lambda name: table_links(name) or (  # noqa: E731
        {"intra_node": {"bus_gbps": 100.0, "latency_s": 1e-5},
         "inter_node": {"bus_gbps": 10.0, "latency_s": 1e-5}}, "the test")
    profile = measure_profile(128, 512, 256, links, (model, 128, 2, False))
    assert profile["hbm_gbps"] > 0 and profile["host_adam"]["params_per_s"] > 0
    assert profile["block_overhead"]["compiled"] is False
    assert profile["block_overhead"]["dropout"] == 0.1
    save_profile(tmp_path / "p.json", profile)
    loaded = load_profile_file(tmp_path / "p.json")
    assert loaded.hbm_gbps == profile["hbm_gbps"] and loaded.prices_offload()
    # FP8 matmuls (compute capability >= 8.9): their rate measured and loaded (not compared
    # with bf16's: small products; written, not yet run on a GPU)
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    assert ("fp8" in loaded.matmul_tflops) == fp8
    assert not fp8 or loaded.rate("fp8") > 0
    assert loaded.block_fits[0].n_embd == 128
