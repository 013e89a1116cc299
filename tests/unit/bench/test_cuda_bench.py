"""The offload benchmark on a GPU (megalite_bench/offload.py): each variant built, timed and
freed in turn (the device memory after a variant is what it was before it), the offload
waits measured with CUDA events, every timed step's seconds and, under optimizer offload, the
timeline of copies (CUDA events on the side stream) and host steps on one clock; the MoE
benchmark's grouped GEMM against the loop in bf16 (megalite_bench/moe.py). Skipped
without a GPU; `megalite-bench gpu` runs it. Written against CUDA semantics; not yet run on a
GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_variants_are_freed_and_waits_are_device_time():
    from megalite.config.schema import load_config
    from megalite_bench.offload import build_variant, random_batches, time_variant

    device = torch.device("cuda")
    mcfg = load_config(["model.n_layer=2", "model.n_embd=128", "model.n_head=4",
                        "model.vocab_size=1024", "model.resid_pdrop=0", "model.embd_pdrop=0",
                        "model.attn_pdrop=0"]).model
    batches = random_batches(mcfg.vocab_size, 2, 64, 2, device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    for fraction, activations in ((0.0, False), (1.0, False), (0.5, True)):
        got = time_variant(lambda: build_variant(mcfg, device, torch.bfloat16, "bf16", 2, 64, fraction,
                                        activations, batches), device, warmup=1, steps=2)
        assert got["step_s"] > 0 and got["peak_memory_gib"] > 0
        assert got["offload_wait_s"] >= 0 and (fraction > 0 or got["offload_wait_s"] == 0)
        assert len(got["times_s"]) == 2 and ("timeline" in got) == (fraction > 0)
        if fraction > 0:  # the copies on the side stream and the host steps, one clock
            kinds = {s["kind"] for s in got["timeline"]}
            assert {"step", "d2h", "host_step", "h2d"} <= kinds, kinds
            steps = [s for s in got["timeline"] if s["kind"] == "step"]
            assert all(0 <= s["start_s"] <= s["end_s"] for s in got["timeline"])
            assert steps[-1]["end_s"] == pytest.approx(sum(got["times_s"]), rel=0.5)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(device) <= before + 2**20  # nothing left alive


def test_moe_bench_times_grouped_gemm_in_bf16_against_the_loop(tmp_path):
    """`megalite-bench moe` on the GPU: megalite's default (experts_impl=auto) is grouped GEMM
    in bf16, the layer's grouped GEMM equals the loop within bf16's tolerance before timing,
    and every training-step arm runs (megalite bf16, transformers under autocast)."""
    import json

    from megalite_bench.cli import main

    main(["moe", "--model", "n_layer=1", "n_embd=64", "n_head=2", "n_kv_head=1",
          "vocab_size=256", "n_inner=32", "--seq-len", "16", "--micro-batch", "2",
          "--layer-tokens", "64", "--steps", "1", "--warmup", "1", "--repeats", "2",
          "--device", "cuda", "--out", str(tmp_path / "moe.json")])
    got = json.loads((tmp_path / "moe.json").read_text())
    assert got["auto"] == "grouped"
    assert got["layer"]["dtype"] == "bfloat16" and got["layer"]["max_rel_difference"] <= 2e-2
    assert {"megalite moe grouped", "megalite moe loop", "megalite dense",
            "transformers eager"} <= set(got["step"]["arms"])
    assert all(a["s"] > 0 for a in got["layer"]["arms"].values())
