"""Device calibration (`scripts/plan.py --calibrate`, megalite/plan/calibrate.py) and the profile file
it writes (megalite/plan/profile_file.py): a 2-rank gloo calibration writes a profile that loads with
sane fields; damaged, truncated, foreign, old and ill-typed files are refused naming the fault."""
from __future__ import annotations

import json
import os

import pytest

from megalite.plan.calibrate import CalibrationError, matmul_rates, matmul_shapes, measure_profile
from megalite.plan.calibrate_links import (
    bus_factor,
    fit_link,
    group_sizes,
    inter_node_groups,
    intra_node_groups,
)
from megalite.plan.profile_file import FORMAT, OPS, ProfileError, load_profile, profile_crc32, save_profile


def synthetic_profile() -> dict:
    link = {"bus_gbps": 100.0, "latency_s": 1e-5}
    return {"name": "test-gpu", "device": "Test GPU 80GB", "memory_bytes": 80 * 2 ** 30,
            "matmul_tflops": {"bf16": 700.0, "fp32": 50.0},
            "links": {"intra_node": dict(link), "inter_node": {"bus_gbps": 20.0,
                                                               "latency_s": 5e-5}},
            "gpus_per_node": 8,
            "sweep": [{"op": "all_reduce", "group_size": 8, "bytes": 2 ** 20,
                       "seconds": 3e-5, "bus_gbps": 61.2}],
            "matmul_sweep": [{"m": 4096, "n": 3072, "k": 768, "dtype": "bf16",
                              "tflops": 700.0}]}


def test_single_process_takes_links_from_the_table_or_stops(monkeypatch, tmp_path):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    links = synthetic_profile()["links"]
    profile = measure_profile(64, 256, 32, table_links=lambda name: (links, "the test table"))
    assert profile["sweep"] == [] and profile["links"] == links
    assert any("not measured (a single process): from the test table" in n
               for n in profile["notes"])
    written = save_profile(tmp_path / "p.json", profile)
    assert load_profile(tmp_path / "p.json") == written
    with pytest.raises(CalibrationError, match="no links for .*nproc_per_node=2"):
        measure_profile(64, 256, 32, table_links=lambda name: None)


def test_link_fit_and_bus_bandwidth():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 2) == 0.5 and bus_factor("send_recv", 8) == 1.0
    latency, gbps = 2e-5, 80.0
    entries = [{"op": op, "group_size": 4, "bytes": b,
                "seconds": latency + b * bus_factor(op, 4) / (gbps * 1e9), "bus_gbps": 1.0}
               for op in OPS for b in (2 ** 16, 2 ** 20, 2 ** 24)]
    assert fit_link(entries) == pytest.approx({"bus_gbps": gbps, "latency_s": latency})
    assert group_sizes(8) == [2, 4, 8] and group_sizes(6) == [2, 6] and group_sizes(1) == []
    assert intra_node_groups(8, 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert inter_node_groups(8, 4, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert inter_node_groups(12, 4, 3) == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert matmul_shapes(768, 3072, 4096) == [(4096, 3072, 768), (4096, 768, 3072)]
    rates = matmul_rates([{"m": 1, "n": 1, "k": 1, "dtype": "fp32", "tflops": 1.0},
                          {"m": 1, "n": 1, "k": 3, "dtype": "fp32", "tflops": 6.0}])
    assert rates == pytest.approx({"fp32": 8 / 3})  # 8 FLOPs in 3e-12 s (not the mean, 3.5)


def test_profile_round_trip_and_atomic_write(tmp_path, monkeypatch):
    path = tmp_path / "h.json"
    written = save_profile(path, synthetic_profile())
    assert load_profile(path) == written and written["format"] == FORMAT
    assert written["crc32"] == profile_crc32(written)
    before = path.read_bytes()

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)  # a crash between writing and publishing
    with pytest.raises(OSError):
        save_profile(path, {**synthetic_profile(), "name": "other"})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["h.json"]


def _written(tmp_path, edit=None) -> tuple:
    path = tmp_path / "p.json"
    save_profile(path, synthetic_profile())
    if edit:
        body = json.loads(path.read_text())
        edit(body)
        body["crc32"] = profile_crc32(body)  # a well-formed file with the fault in its fields
        path.write_text(json.dumps(body))
    return path


def test_damaged_profiles_are_refused(tmp_path):
    path = _written(tmp_path)
    data = bytearray(path.read_bytes())
    data[data.index(b"test-gpu") + 7] ^= 0x01  # one flipped bit: "test-gpu" -> "test-gpt"
    path.write_bytes(bytes(data))
    with pytest.raises(ProfileError, match=f"{path}: damaged device profile: CRC32 mismatch"):
        load_profile(path)
    path.write_bytes(_written(tmp_path).read_bytes()[:200])  # truncated
    with pytest.raises(ProfileError, match=f"{path}: damaged device profile, not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.pop("links"), "links=None: must be an object"),
    (lambda p: p["matmul_tflops"].update(bf16=0.0), r"matmul_tflops.bf16=0.0: must be .* > 0"),
    (lambda p: p["matmul_tflops"].update(int8=1.0), "matmul_tflops has 'int8'"),
    (lambda p: p["links"]["inter_node"].update(bus_gbps=-3), r"inter_node.bus_gbps=-3"),
    (lambda p: p.update(memory_bytes="80GB"), "memory_bytes='80GB': must be a positive integer"),
    (lambda p: p["sweep"][0].update(op="broadcast"), r"sweep\[0\].op='broadcast'"),
    (lambda p: p.update(matmul_sweep=[]), "matmul_sweep=.*non-empty"),
    (lambda p: p.update(hbm_gbps=0), "hbm_gbps=0: must be"),
    (lambda p: p.update(host_link={"h2d_gbps": 50.0}), r"host_link.d2h_gbps=None"),
    (lambda p: p.update(host_adam={"params_per_s": 1e9, "threads": 0}), "host_adam.threads=0"),
    (lambda p: p.update(block_overhead={"fixed_s": 1e-3, "per_token_s": 1e-9}),
     "block_overhead.n_embd=None"),
    (lambda p: p.update(block_overhead={"fixed_s": 1e-3, "per_token_s": 1e-9, "n_embd": 64,
                                        "dropout": 1.5}), r"block_overhead.dropout=1.5"),
], ids=["no_links", "zero_rate", "unknown_dtype", "negative_bw", "memory_str", "op", "no_mm",
        "hbm", "host_link", "host_adam", "block_width", "block_dropout"])
def test_ill_typed_profiles_are_refused(tmp_path, edit, message):
    path = _written(tmp_path, edit)
    with pytest.raises(ProfileError, match=f"{path}: invalid device profile: .*{message}"):
        load_profile(path)


def test_foreign_and_other_version_profiles_are_refused(tmp_path):
    path = _written(tmp_path, lambda p: p.update(format="megatron-profile"))
    with pytest.raises(ProfileError, match="not a megalite device profile "
                                           r"\(format='megatron-profile'"):
        load_profile(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ProfileError, match="not a megalite device profile"):
        load_profile(path)
    path = _written(tmp_path, lambda p: p.update(version=2))
    with pytest.raises(ProfileError, match="device profile version 2; this megalite reads "
                                           "version 1"):
        load_profile(path)
    with pytest.raises(ProfileError, match="refusing to write .*gpus_per_node=0"):
        save_profile(tmp_path / "bad.json", {**synthetic_profile(), "gpus_per_node": 0})


def test_plan_still_requires_world_size_without_calibrate(capsys):
    from megalite.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(["model=gpt2"])
    assert e.value.code == 2 and "--world-size" in capsys.readouterr().err


def test_calibrate_refuses_bad_sizes_before_measuring(capsys, tmp_path):
    from megalite.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(["--calibrate", "--output", str(tmp_path / "p.json"), "train.seq_len=0"])
    assert e.value.code == 2 and "train.seq_len=0" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_measured_host_figures_replace_the_tables(tmp_path):
    """A profile that measured HBM, the pinned copies and the host AdamW is planned with them;
    one that did not takes its device's table entry's (an H100 here)."""
    from dataclasses import replace

    from megalite.plan.devices import BY_NAME, load_profile_file

    h100 = {**synthetic_profile(), "device": "NVIDIA H100 80GB HBM3"}
    save_profile(tmp_path / "table.json", h100)
    tabled = load_profile_file(tmp_path / "table.json")
    entry = BY_NAME["h100-80gb"]
    assert (tabled.hbm_gbps, tabled.h2d_gbps, tabled.d2h_gbps, tabled.host_adam_params_per_s,
            tabled.block_fits) == (entry.hbm_gbps, entry.h2d_gbps, entry.d2h_gbps,
                                   entry.host_adam_params_per_s, entry.block_fits)
    measured = {**h100, "hbm_gbps": 3000.0, "host_link": {"h2d_gbps": 40.0, "d2h_gbps": 30.0},
                "host_adam": {"params_per_s": 2e9, "threads": 8},
                "block_overhead": {"fixed_s": 1e-3, "per_token_s": 1e-8, "n_embd": 64,
                                   "dropout": 0.0, "compiled": True}}
    save_profile(tmp_path / "measured.json", measured)
    p = load_profile_file(tmp_path / "measured.json")
    assert (p.hbm_gbps, p.h2d_gbps, p.d2h_gbps, p.host_adam_params_per_s, p.host_threads) == \
        (3000.0, 40.0, 30.0, 2e9, 8)
    (fit,) = p.block_fits
    assert (fit.n_embd, fit.dropout, fit.compiled) == (64, 0.0, True)
    assert p.host_adam_per_rank(4) == 0.5e9 and replace(p, host_adam_params_per_s=None) \
        .host_adam_per_rank(4) is None


def test_host_adam_rate_on_this_host():
    """The fused (or foreach) CPU AdamW over a small model, on the threads asked for; torch's
    thread count is put back."""
    import torch

    from megalite.plan.calibrate_host import measure_host_adam, rank_threads

    before = torch.get_num_threads()
    got = measure_host_adam(1, numel=80_000)
    assert got["params_per_s"] > 0 and got["threads"] == 1 and got["kind"] in ("fused",
                                                                               "foreach")
    assert torch.get_num_threads() == before
    assert rank_threads(1) >= rank_threads(10**6) == 1
