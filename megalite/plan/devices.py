"""The one device table: what an accelerator computes, holds and sends, for the metrics' MFU
(the data-sheet peak) and for the planner's time model (achievable rates and links).

Per entry (vendors' data sheets; dense, no sparsity):

  peak_tflops_bf16   data-sheet dense bf16 tensor peak (V100: fp16): the MFU denominator
  matmul_tflops      *achievable* matmul TFLOP/s by dtype: the planner's compute rate. The table
                     assumes `TABLE_MATMUL_EFFICIENCY` of the data-sheet peak (large cuBLAS
                     GEMMs); `scripts/plan.py --calibrate` measures it on the machine instead
  memory_bytes       device memory; hbm_gbps its bandwidth (GB/s: the optimizer step)
  intra_node         collective bus bandwidth (nccl-tests "busbw", GB/s) and latency per
                     collective inside a node (NVLink / PCIe)
  inter_node         the same across nodes with one rank per node: one GPU's own NIC rail. A
                     group with k ranks on each node gets k rails (rail-optimized nodes, one NIC
                     per GPU), at most the intra-node bus bandwidth
  host_link_gbps     device <-> host copies (PCIe): activation and optimizer offload
  host_memory_gbps   one rank's share of the host's memory bandwidth: the host AdamW of
                     offload.optimizer (a node's ~200 GB/s over its 8 ranks: 25)
  gpus_per_node      the usual node (HGX 8)

Link figures are typical of nccl-tests on such nodes (NVLink3 ~230 GB/s, NVLink4 ~360 GB/s,
HDR 200 Gb/s ~23 GB/s, NDR 400 Gb/s ~45 GB/s per rail), not promises: a calibrated profile
(`--profile FILE`) replaces them. `cpu` is a rough single-core entry with gloo over loopback.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

from megalite.plan.profile_file import load_profile

GIB = 2**30
TABLE_MATMUL_EFFICIENCY = 0.8  # achievable / data-sheet peak assumed by the built-in table


@dataclass(frozen=True)
class Link:
    bus_gbps: float  # GB/s of nccl-tests' bus bandwidth: wire bytes / time of a ring
    latency_s: float  # per collective: the small-message time (nccl-tests), fitted


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # table key or the profile file's name (h100-80gb, a100-80gb, ...)
    device: str  # the accelerator's name, as torch.cuda.get_device_name() gives it
    memory_bytes: int
    matmul_tflops: Mapping[str, float] = field(hash=False)  # achievable, by dtype
    intra_node: Link = Link(1.0, 1e-5)
    inter_node: Link = Link(1.0, 1e-5)
    gpus_per_node: int = 8
    peak_tflops_bf16: Optional[float] = None  # data sheet: MFU's denominator
    hbm_gbps: Optional[float] = None
    host_link_gbps: Optional[float] = None
    host_memory_gbps: Optional[float] = None
    match: Tuple[str, ...] = ()  # whole words of device names this entry stands for
    # a block's forward + backward beyond its matmul FLOPs, per pass and per token (measured
    # by --calibrate at the model's width: megalite/plan/calibrate_block.py; 0 in the table)
    block_fixed_s: float = 0.0
    block_per_token_s: float = 0.0
    # per collective kind (all_reduce, all_gather, reduce_scatter, send_recv): the link's fit
    # for that kind, where --calibrate measured it ({"intra_node": {op: Link}, ...})
    op_links: Mapping[str, Mapping[str, Link]] = field(default_factory=dict, hash=False)
    source: str = "table"

    def rate(self, precision: str) -> float:
        """Achievable matmul FLOP/s in `precision` (bf16 | fp16 | fp32)."""
        if precision not in self.matmul_tflops:
            known = ", ".join(sorted(self.matmul_tflops)) or "none"
            raise ValueError(f"device profile {self.name!r} has no matmul rate for "
                             f"{precision} (it has: {known}); calibrate in {precision} or "
                             "choose another precision")
        return self.matmul_tflops[precision] * 1e12

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        """A profile file's dict (format `megalite-device-profile`, version 1; its raw
        `sweep` is not needed here). Fields the file does not measure (data-sheet peak, HBM
        and host-link bandwidth) come from the table entry of its `device`, when known."""
        def link(key: str) -> Link:
            x = d["links"][key]
            return Link(float(x["bus_gbps"]), float(x["latency_s"]))
        known = table_entry_for(d["device"], d.get("memory_bytes")) or (
            BY_NAME["cpu"] if str(d["device"]).startswith("cpu") else None)
        return cls(name=d["name"], device=d["device"], memory_bytes=int(d["memory_bytes"]),
                   matmul_tflops={k: float(v) for k, v in d["matmul_tflops"].items()},
                   intra_node=link("intra_node"), inter_node=link("inter_node"),
                   gpus_per_node=int(d["gpus_per_node"]),
                   peak_tflops_bf16=known.peak_tflops_bf16 if known else None,
                   hbm_gbps=known.hbm_gbps if known else None,
                   host_link_gbps=known.host_link_gbps if known else None,
                   host_memory_gbps=known.host_memory_gbps if known else None,
                   op_links={name: {op: Link(float(f["bus_gbps"]), float(f["latency_s"]))
                                    for op, f in ops.items()}
                             for name, ops in d.get("op_links", {}).items()},
                   block_fixed_s=float(d.get("block_overhead", {}).get("fixed_s", 0.0)),
                   block_per_token_s=float(d.get("block_overhead", {}).get("per_token_s",
                                                                           0.0)),
                   source=f"profile {d['name']!r}")


def _gpu(name: str, match: str, peak: float, fp32: float, mem: float, hbm: float,
         intra: Tuple[float, float], inter: Tuple[float, float], host: float,
         per_node: int = 8) -> DeviceProfile:
    eff = TABLE_MATMUL_EFFICIENCY
    return DeviceProfile(
        name=name, device=f"NVIDIA {match}" if not match.startswith("MI") else f"AMD {match}",
        memory_bytes=int(mem * GIB),
        matmul_tflops={"bf16": peak * eff, "fp16": peak * eff, "fp32": fp32 * eff},
        intra_node=Link(*intra), inter_node=Link(*inter), gpus_per_node=per_node,
        peak_tflops_bf16=peak, hbm_gbps=hbm, host_link_gbps=host, host_memory_gbps=25.0,
        match=(match,),
        source=f"table ({match}, {eff:.0%} of the data-sheet peak)")


NVLINK3, NVLINK4, NVLINK5 = (230.0, 1.5e-5), (360.0, 1.5e-5), (720.0, 1.5e-5)
PCIE4, PCIE5 = (20.0, 2e-5), (40.0, 2e-5)
HDR, NDR = (23.0, 3e-5), (45.0, 3e-5)

# Order matters for device-name matching: more specific names first (an "H100 PCIe" must not
# match plain "H100"; "L40S" before "L40" before "L4").
DEVICES: Tuple[DeviceProfile, ...] = (
    _gpu("h100-pcie", "H100 PCIe", 756.0, 51.0, 80, 2000, PCIE5, NDR, 50),
    _gpu("h100-nvl", "H100 NVL", 835.0, 60.0, 94, 3900, PCIE5, NDR, 50),
    _gpu("h100-80gb", "H100", 989.0, 67.0, 80, 3350, NVLINK4, NDR, 50),  # SXM
    _gpu("h200", "H200", 989.0, 67.0, 139.8, 4800, NVLINK4, NDR, 50),
    _gpu("gh200", "GH200", 989.0, 67.0, 96, 4000, NVLINK4, NDR, 450, per_node=4),
    _gpu("b200", "B200", 2250.0, 80.0, 180, 8000, NVLINK5, NDR, 50),
    _gpu("a100-80gb", "A100", 312.0, 19.5, 80, 2039, NVLINK3, HDR, 25),
    _gpu("a100-40gb", "A100", 312.0, 19.5, 40, 1555, NVLINK3, HDR, 25),
    _gpu("a800", "A800", 312.0, 19.5, 80, 2039, (155.0, 1.5e-5), HDR, 25),
    _gpu("l40s", "L40S", 362.0, 91.6, 48, 864, PCIE4, HDR, 25),
    _gpu("l40", "L40", 181.0, 90.5, 48, 864, PCIE4, HDR, 25),
    _gpu("l4", "L4", 121.0, 30.3, 24, 300, PCIE4, HDR, 25),
    _gpu("a10g", "A10G", 70.0, 31.2, 24, 600, PCIE4, HDR, 25),
    _gpu("a10", "A10", 125.0, 31.2, 24, 600, PCIE4, HDR, 25),
    _gpu("v100", "V100", 125.0, 15.7, 32, 900, (130.0, 1.5e-5), (11.0, 3e-5), 12),  # fp16
    _gpu("mi300x", "MI300X", 1307.0, 163.4, 192, 5300, (300.0, 1.5e-5), NDR, 50),
    _gpu("mi250x", "MI250X", 383.0, 47.9, 128, 3200, (150.0, 1.5e-5), HDR, 25),
    # one CPU core (fp32, AVX2-class), gloo over loopback: rough; calibrate for figures
    DeviceProfile(name="cpu", device="cpu", memory_bytes=16 * GIB,
                  matmul_tflops={"fp32": 0.05}, intra_node=Link(2.0, 1e-4),
                  inter_node=Link(1.0, 2e-4), gpus_per_node=1, hbm_gbps=10.0,
                  host_link_gbps=10.0, host_memory_gbps=10.0,
                  source="table (cpu: one core, gloo on loopback)"),
)
DEVICES = tuple(replace(d, matmul_tflops={k: v for k, v in d.matmul_tflops.items()
                                          if not (d.match == ("V100",) and k == "bf16")})
                for d in DEVICES)  # Volta has no bf16
BY_NAME: Dict[str, DeviceProfile] = {d.name: d for d in DEVICES}


def _names(device_name: str, key: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name) \
        is not None


def table_entry_for(device_name: str, memory_bytes: Optional[int] = None
                    ) -> Optional[DeviceProfile]:
    """The table entry for an accelerator's name (whole words, most specific first); among
    entries of one name (A100 40/80 GB) the one whose memory is nearest `memory_bytes`."""
    for d in DEVICES:
        for key in d.match:
            if _names(device_name, key):
                same = [e for e in DEVICES if key in e.match]
                if memory_bytes is None:
                    return same[0]
                return min(same, key=lambda e: abs(e.memory_bytes - memory_bytes))
    return None


def table_peak_tflops(device_name: str) -> Tuple[Optional[float], Optional[str]]:
    """(data-sheet dense bf16 peak, the table key it matched) of a device name, or (None,
    None)."""
    d = table_entry_for(device_name)
    return (d.peak_tflops_bf16, d.match[0]) if d else (None, None)


def device_profile(name: str) -> DeviceProfile:
    """The built-in profile `name`; ValueError listing the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(BY_NAME)} "
                         "(or --profile FILE from --calibrate)")
    return BY_NAME[name]


def load_profile_file(path) -> DeviceProfile:
    """The calibrated profile in `path` (`scripts/plan.py --profile FILE`); ValueError naming
    the file when it is damaged or foreign."""
    d = load_profile(path)
    if isinstance(d, DeviceProfile):
        return d
    try:
        return DeviceProfile.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"--profile {path}: missing or malformed field ({e!r})") from e


def table_links(device_name: str) -> Optional[Tuple[dict, str]]:
    """The table's links for a device name, as a profile file writes them (what
    `scripts/plan.py --calibrate` records for a single process, which measures no link), with
    where they come from; None for a device the table does not know."""
    d = table_entry_for(device_name)
    if d is None:
        return None
    return ({"intra_node": {"bus_gbps": d.intra_node.bus_gbps,
                            "latency_s": d.intra_node.latency_s},
             "inter_node": {"bus_gbps": d.inter_node.bus_gbps,
                            "latency_s": d.inter_node.latency_s}},
            f"the device table ({d.name}: {d.source})")
