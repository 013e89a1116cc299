"""What a run reports, in isolation: the peak FLOP/s table and metrics.jsonl as standard JSON.
(End to end — loss, throughput, MFU, memory, communication in metrics.jsonl and wandb — in
tests/integration/cli/test_pretrain.py.)"""
import json

import pytest

from megalite.train.metrics import MetricsWriter, Peak, table_peak, throughput


@pytest.mark.parametrize("name,tflops,key", [
    ("NVIDIA H100 80GB HBM3", 989.0, "H100"),
    ("NVIDIA H100 PCIe", 756.0, "H100 PCIe"),
    ("NVIDIA GH200 480GB", 989.0, "GH200"),
    ("NVIDIA H200", 989.0, "H200"),
    ("NVIDIA L4", 121.0, "L4"),
    ("NVIDIA L40", 181.0, "L40"),
    ("NVIDIA L40S", 362.0, "L40S"),
    ("NVIDIA A10G", 70.0, "A10G"),
    ("NVIDIA A100-SXM4-80GB", 312.0, "A100"),
])
def test_device_names_match_whole_table_entries(name, tflops, key):
    peak = table_peak(name)
    assert peak.tflops == tflops and peak.source.endswith(f"({key})"), peak


def test_unknown_device_gets_no_peak():
    peak = table_peak("NVIDIA RTX 9999")
    assert peak.tflops is None and "log.peak_tflops" in peak.source


def test_non_finite_values_are_written_as_null(tmp_path):
    writer = MetricsWriter(tmp_path, {"peak": float("inf")}, "false", "p", None, {}, 2, 0,
                           progress=False)
    writer.log({"step": 1, "loss": None, "grad_norm": float("nan"),
                "comm": {"dp/all_reduce": {"bytes": 4, "rate": float("-inf")}}, "ok": 1.5})
    writer.close()

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    header, record = [json.loads(line, parse_constant=refuse)
                      for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert header == {"run": {"peak": None}}
    assert record == {"step": 1, "loss": None, "grad_norm": None,
                      "comm": {"dp/all_reduce": {"bytes": 4, "rate": None}}, "ok": 1.5}


def test_throughput_is_per_device_against_the_peak():
    """tokens/s of the whole job; TFLOP/s and MFU per device: 8 devices at 1,000 tokens/s
    each of a 6e9-FLOP/token model do 6 TFLOP/s each, 60% of a 10 TFLOP/s peak."""
    out = throughput(tokens=16_000, seconds=2.0, flops_per_token=6_000_000_000, world_size=8,
                     peak=Peak(10.0, "test"))
    assert out == pytest.approx({"tokens_per_s": 8_000.0, "tflops_per_device": 6.0,
                                 "mfu": 0.6})
    assert throughput(16_000, 2.0, 6_000_000_000, 8, Peak(None, "unknown"))["mfu"] is None
