"""The one device table: what an accelerator computes, holds and sends, for the metrics' MFU
(the data-sheet peak) and for the planner's time model (achievable rates, links, host).

Per entry:

  peak_tflops_bf16   data-sheet dense bf16 tensor peak (V100: fp16): the MFU denominator
  peak_tflops_fp8    data-sheet dense FP8 tensor peak (e4m3, no sparsity), on the GPUs with
                     FP8 matmuls (compute capability >= 8.9): named beside MFU in an FP8 run,
                     never its denominator (docs/fp8.md)
  matmul_tflops      *achievable* matmul TFLOP/s by dtype: the planner's compute rate ("fp8":
                     the FP8 linears of `fp8.recipe`; an estimate everywhere, below)
  block_fits         a transformer block's forward + backward beyond its matmul FLOPs
                     (LayerNorms, GELU, dropout, residual adds, the attention kernel's time
                     beyond its FLOPs at the matmul rate, launches), `BlockFit`s at the widths
                     it was measured at: `block_pass_s` interpolates between them
  memory_bytes       device memory; hbm_gbps its bandwidth (GB/s): the memory-bound terms
                     (the loss, gradient accumulation, the optimizer step, dropout)
  intra_node         collective bus bandwidth (nccl-tests "busbw", GB/s) and latency per
                     collective inside a node (NVLink / PCIe)
  inter_node         the same across nodes with one rank per node: one GPU's own NIC rail. A
                     group with k ranks on each node gets k rails (rail-optimized nodes, one NIC
                     per GPU), at most the intra-node bus bandwidth
  h2d_gbps, d2h_gbps pinned host -> device and device -> host copies (GB/s, one direction at a
                     time): activation and optimizer offload
  host_adam_params_per_s, host_threads
                     the fused CPU AdamW (offload.optimizer's host step) over a node's
                     `host_threads` threads, parameters a second; a node's ranks share it
  gpus_per_node      the usual node (HGX 8)

Where the numbers come from:

- **h100-80gb** (H100 80GB HBM3, SXM) takes its rates from one H100 measured by
  `scripts/plan.py --calibrate` at main 5f08fbc (the two profile files and the figures are
  committed under tests/fixtures/gpu/): matmul by dtype, the FLOP-weighted harmonic mean over
  the MLP shapes of gpt2 (16,384 tokens) and gpt2-xl (4,096 tokens) in both files; a block's
  time beyond its FLOPs at both widths, 768 and 1600 (each file's measured block seconds
  refitted at that matmul rate: `H100_BLOCK_FITS`); the fused host AdamW, 4.73e9 parameters/s
  on 16 threads (`scripts/bench.py offload`). Not measured there, so still data-sheet or
  typical figures: HBM 3,350 GB/s, the pinned copies (50 GB/s each way, ~80% of PCIe 5 x16),
  the links.
- every other GPU: an **estimate**, derived from its data sheet the same way: matmul at the
  H100's measured fraction of the data-sheet peak (bf16/fp16 and fp32 apart), the block fits
  scaled by 3,350 / its HBM bandwidth (the non-matmul work is memory-bound), the H100 host's
  AdamW, copies at ~80% of its host link. `scripts/plan.py --calibrate` on the machine
  replaces every measured field (`--profile FILE`).
- the **fp8** matmul rate of every GPU that has one, the H100 too: an estimate, its dense FP8
  data-sheet peak at the H100's measured bf16 fraction (nothing has measured FP8 matmuls
  on a GPU yet; `--calibrate` times `torch._scaled_mm` on a GPU of compute capability >= 8.9
  into a profile's `fp8` rate, a path not yet run). The MI300X's FP8 (e4m3fnuz) is not the
  format megalite casts to (e4m3fn): no FP8 entry.

Link figures are typical of nccl-tests on such nodes (NVLink3 ~230 GB/s, NVLink4 ~360 GB/s,
HDR 200 Gb/s ~23 GB/s, NDR 400 Gb/s ~45 GB/s per rail), not promises. `cpu` is a rough
single-core entry with gloo over loopback.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Sequence, Tuple

from megalite.plan.profile_file import load_profile, mask_ratios_of

GIB = 2**30

# --- one H100 80GB HBM3 (SXM), measured at main 5f08fbc (tests/fixtures/gpu/) ----------------
H100_PEAK_TFLOPS = {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}  # data sheet, dense
H100_PEAK_FP8_TFLOPS = 1979.0  # data sheet, dense e4m3
# matmul_rates() over both files' six MLP shapes each (tests/unit/plan/test_time_model_h100.py
# recomputes these from the files)
H100_MATMUL_TFLOPS = {"bf16": 661.2514465060702, "fp16": 645.8824259403674,
                      "fp32": 44.53164461817917}
H100_HBM_GBPS = 3350.0  # data sheet (not measured)
H100_HOST_ADAM_PARAMS_PER_S = 4.73e9  # fused CPU AdamW, 20M fp32 parameters, 16 threads
H100_HOST_THREADS = 16


@dataclass(frozen=True)
class BlockFit:
    """A transformer block's forward + backward beyond its matmul FLOPs at the matmul rate,
    measured at one width: `fixed_s + per_token_s · tokens` a pass
    (megalite/plan/calibrate_block.py)."""

    n_embd: int
    fixed_s: float
    per_token_s: float
    dropout: Optional[float] = None  # the measured block's dropout p (None: not recorded)
    compiled: bool = False  # measured under torch.compile

    def at(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


# Each file's measured block seconds (gpt2: 16,384 and 32,768 tokens; gpt2-xl: 4,096 and
# 8,192) less the block's FLOPs at H100_MATMUL_TFLOPS["bf16"], fitted through the two points
# (calibrate_block.fit_nonnegative_line); eager, the presets' dropout 0.1 (the calibration
# built the block of `model=gpt2` / `model=gpt2-xl` in training mode).
H100_BLOCK_FITS = (BlockFit(768, 3.388710000038486e-04, 7.125281229550359e-08, 0.1),
                   BlockFit(1600, 1.151200999991886e-03, 4.221863876203753e-08, 0.1))


def block_pass_s(fits: Sequence[BlockFit], n_embd: int, tokens: float, tp: int = 1) -> float:
    """Seconds of one block pass (forward + backward) beyond its matmul FLOPs, at width
    `n_embd` over `tokens` tokens, the block split over `tp` ranks: 0 without fits. At a
    measured width, that fit (its per-token part / tp); between two measured widths, the
    linear interpolation in the width of theirs; beyond them the nearest, its per-token part
    scaled by n_embd / its width (elementwise work grows with the width)."""
    if not fits:
        return 0.0
    fits = sorted(fits, key=lambda f: f.n_embd)
    per_rank = tokens / tp
    below = [f for f in fits if f.n_embd <= n_embd]
    above = [f for f in fits if f.n_embd >= n_embd]
    if below and above:
        a, b = below[-1], above[0]
        if a.n_embd == b.n_embd:
            return a.at(per_rank)
        w = (n_embd - a.n_embd) / (b.n_embd - a.n_embd)
        return (1 - w) * a.at(per_rank) + w * b.at(per_rank)
    f = above[0] if above else below[-1]
    return f.fixed_s + f.per_token_s * n_embd / f.n_embd * per_rank


def fits_dropout(fits: Sequence[BlockFit]) -> Optional[float]:
    """The dropout p the fits were measured with, where they agree and it was recorded."""
    ps = {f.dropout for f in fits}
    return ps.pop() if len(ps) == 1 else None


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
    peak_tflops_fp8: Optional[float] = None  # data sheet, dense FP8: named beside MFU
    hbm_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None  # pinned host -> device
    d2h_gbps: Optional[float] = None  # device -> pinned host
    host_adam_params_per_s: Optional[float] = None  # fused CPU AdamW over host_threads
    host_threads: Optional[int] = None
    match: Tuple[str, ...] = ()  # whole words of device names this entry stands for
    block_fits: Tuple[BlockFit, ...] = ()  # a block's time beyond its FLOPs, by width
    # per collective kind (all_reduce, all_gather, reduce_scatter, send_recv): the link's fit
    # for that kind, where --calibrate measured it ({"intra_node": {op: Link}, ...})
    op_links: Mapping[str, Mapping[str, Link]] = field(default_factory=dict, hash=False)
    # per document-mask kernel (flex, varlen, sdpa): its time per unit of work over the causal
    # attention's FLOPs at the matmul rate, where --calibrate measured it (calibrate_mask)
    mask_ratios: Mapping[str, float] = field(default_factory=dict, hash=False)
    source: str = "table"

    @property
    def device_type(self) -> str:
        """The layout's device type on this device: cpu (the table's entry, or a calibrated
        CPU's "cpu: <model>") or cuda."""
        return "cpu" if self.device.startswith("cpu") else "cuda"

    def rate(self, precision: str) -> float:
        """Achievable matmul FLOP/s in `precision` (bf16 | fp16 | fp32)."""
        if precision not in self.matmul_tflops:
            known = ", ".join(sorted(self.matmul_tflops)) or "none"
            raise ValueError(f"device profile {self.name!r} has no matmul rate for "
                             f"{precision} (it has: {known}); calibrate in {precision} or "
                             "choose another precision")
        return self.matmul_tflops[precision] * 1e12

    def block_pass_s(self, n_embd: int, tokens: float, tp: int = 1) -> float:
        return block_pass_s(self.block_fits, n_embd, tokens, tp)

    def prices_offload(self) -> bool:
        """Whether the profile has what the offload terms need (copies both ways, the host
        AdamW)."""
        return bool(self.h2d_gbps and self.d2h_gbps and self.host_adam_params_per_s)

    def host_adam_per_rank(self, ranks_per_node: int) -> Optional[float]:
        """Host AdamW parameters a second for one of `ranks_per_node` ranks sharing the node's
        threads (offload gives each rank its share: megalite.train.host_threads)."""
        if not self.host_adam_params_per_s:
            return None
        return self.host_adam_params_per_s / max(1, ranks_per_node)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        """A profile file's dict (format `megalite-device-profile`, version 1; its raw
        `sweep` is not needed here). Fields the file does not measure (the data-sheet peak;
        HBM, copies, host AdamW and block fits where it has none) come from the table entry
        of its `device`, when known."""
        def link(key: str) -> Link:
            x = d["links"][key]
            return Link(float(x["bus_gbps"]), float(x["latency_s"]))
        known = table_entry_for(d["device"], d.get("memory_bytes")) or (
            BY_NAME["cpu"] if str(d["device"]).startswith("cpu") else None)
        host_link, adam = d.get("host_link", {}), d.get("host_adam", {})
        block = d.get("block_overhead")
        fits = (BlockFit(int(block.get("n_embd", 0)), float(block["fixed_s"]),
                         float(block["per_token_s"]), _optional(block.get("dropout")),
                         bool(block.get("compiled", False))),) if block else \
            (known.block_fits if known else ())

        def measured(value, key):
            return float(value) if value is not None else getattr(known, key, None)
        return cls(name=d["name"], device=d["device"], memory_bytes=int(d["memory_bytes"]),
                   matmul_tflops={k: float(v) for k, v in d["matmul_tflops"].items()},
                   intra_node=link("intra_node"), inter_node=link("inter_node"),
                   gpus_per_node=int(d["gpus_per_node"]),
                   peak_tflops_bf16=known.peak_tflops_bf16 if known else None,
                   peak_tflops_fp8=known.peak_tflops_fp8 if known else None,
                   hbm_gbps=measured(d.get("hbm_gbps"), "hbm_gbps"),
                   h2d_gbps=measured(host_link.get("h2d_gbps"), "h2d_gbps"),
                   d2h_gbps=measured(host_link.get("d2h_gbps"), "d2h_gbps"),
                   host_adam_params_per_s=measured(adam.get("params_per_s"),
                                                   "host_adam_params_per_s"),
                   host_threads=int(adam["threads"]) if "threads" in adam else
                   getattr(known, "host_threads", None),
                   op_links={name: {op: Link(float(f["bus_gbps"]), float(f["latency_s"]))
                                    for op, f in ops.items()}
                             for name, ops in d.get("op_links", {}).items()},
                   mask_ratios=mask_ratios_of(d.get("document_mask")),
                   block_fits=fits, source=f"profile {d['name']!r}")


def _optional(value) -> Optional[float]:
    return None if value is None else float(value)


def _gpu(name: str, match: str, peak: float, fp32: float, mem: float, hbm: float,
         intra: Tuple[float, float], inter: Tuple[float, float], host: float,
         per_node: int = 8, fp8: Optional[float] = None) -> DeviceProfile:
    """An entry derived from its data sheet the H100's way (module docstring): an estimate.
    `fp8`: the dense FP8 peak, where the GPU has FP8 matmuls."""
    ratio = {d: H100_MATMUL_TFLOPS[d] / H100_PEAK_TFLOPS[d] for d in H100_MATMUL_TFLOPS}
    scale = H100_HBM_GBPS / hbm
    return DeviceProfile(
        name=name, device=f"NVIDIA {match}" if not match.startswith("MI") else f"AMD {match}",
        memory_bytes=int(mem * GIB),
        matmul_tflops={"bf16": peak * ratio["bf16"], "fp16": peak * ratio["fp16"],
                       "fp32": fp32 * ratio["fp32"], **fp8_rate(fp8)},
        intra_node=Link(*intra), inter_node=Link(*inter), gpus_per_node=per_node,
        peak_tflops_bf16=peak, peak_tflops_fp8=fp8, hbm_gbps=hbm, h2d_gbps=host, d2h_gbps=host,
        host_adam_params_per_s=H100_HOST_ADAM_PARAMS_PER_S, host_threads=H100_HOST_THREADS,
        match=(match,),
        block_fits=tuple(replace(f, fixed_s=f.fixed_s * scale, per_token_s=f.per_token_s * scale)
                         for f in H100_BLOCK_FITS),
        source=f"table ({match}: an estimate from its data sheet and one H100's measured "
               "ratios)")


def _h100_sxm() -> DeviceProfile:
    """The entry measured on one H100 80GB HBM3 (module docstring)."""
    return DeviceProfile(
        name="h100-80gb", device="NVIDIA H100", memory_bytes=80 * GIB,
        matmul_tflops={**H100_MATMUL_TFLOPS, **fp8_rate(H100_PEAK_FP8_TFLOPS)},
        intra_node=Link(*NVLINK4), inter_node=Link(*NDR), gpus_per_node=8,
        peak_tflops_bf16=H100_PEAK_TFLOPS["bf16"], peak_tflops_fp8=H100_PEAK_FP8_TFLOPS,
        hbm_gbps=H100_HBM_GBPS, h2d_gbps=50.0, d2h_gbps=50.0,
        host_adam_params_per_s=H100_HOST_ADAM_PARAMS_PER_S, host_threads=H100_HOST_THREADS,
        match=("H100",), block_fits=H100_BLOCK_FITS,
        source="table (H100: matmul, block and host AdamW rates measured on one H100 80GB "
               "HBM3 at 5f08fbc; HBM, copies and links data-sheet or typical; fp8 an "
               "estimate)")


def fp8_rate(peak: Optional[float]) -> Dict[str, float]:
    """The estimated achievable FP8 matmul rate ({"fp8": TFLOP/s}, {} without FP8): the
    dense FP8 peak at the H100's measured bf16 fraction of its peak (module docstring)."""
    if peak is None:
        return {}
    return {"fp8": peak * H100_MATMUL_TFLOPS["bf16"] / H100_PEAK_TFLOPS["bf16"]}


NVLINK3, NVLINK4, NVLINK5 = (230.0, 1.5e-5), (360.0, 1.5e-5), (720.0, 1.5e-5)
PCIE4, PCIE5 = (20.0, 2e-5), (40.0, 2e-5)
HDR, NDR = (23.0, 3e-5), (45.0, 3e-5)

# Order matters for device-name matching: more specific names first (an "H100 PCIe" must not
# match plain "H100"; "L40S" before "L40" before "L4").
DEVICES: Tuple[DeviceProfile, ...] = (
    _gpu("h100-pcie", "H100 PCIe", 756.0, 51.0, 80, 2000, PCIE5, NDR, 50, fp8=1513.0),
    _gpu("h100-nvl", "H100 NVL", 835.0, 60.0, 94, 3900, PCIE5, NDR, 50, fp8=1671.0),
    _h100_sxm(),
    _gpu("h200", "H200", 989.0, 67.0, 139.8, 4800, NVLINK4, NDR, 50, fp8=1979.0),
    _gpu("gh200", "GH200", 989.0, 67.0, 96, 4000, NVLINK4, NDR, 450, per_node=4, fp8=1979.0),
    _gpu("b200", "B200", 2250.0, 80.0, 180, 8000, NVLINK5, NDR, 50, fp8=4500.0),
    _gpu("a100-80gb", "A100", 312.0, 19.5, 80, 2039, NVLINK3, HDR, 25),
    _gpu("a100-40gb", "A100", 312.0, 19.5, 40, 1555, NVLINK3, HDR, 25),
    _gpu("a800", "A800", 312.0, 19.5, 80, 2039, (155.0, 1.5e-5), HDR, 25),
    _gpu("l40s", "L40S", 362.0, 91.6, 48, 864, PCIE4, HDR, 25, fp8=733.0),
    _gpu("l40", "L40", 181.0, 90.5, 48, 864, PCIE4, HDR, 25, fp8=362.0),
    _gpu("l4", "L4", 121.0, 30.3, 24, 300, PCIE4, HDR, 25, fp8=242.0),
    _gpu("a10g", "A10G", 70.0, 31.2, 24, 600, PCIE4, HDR, 25),
    _gpu("a10", "A10", 125.0, 31.2, 24, 600, PCIE4, HDR, 25),
    _gpu("v100", "V100", 125.0, 15.7, 32, 900, (130.0, 1.5e-5), (11.0, 3e-5), 12),  # fp16
    _gpu("mi300x", "MI300X", 1307.0, 163.4, 192, 5300, (300.0, 1.5e-5), NDR, 50),
    _gpu("mi250x", "MI250X", 383.0, 47.9, 128, 3200, (150.0, 1.5e-5), HDR, 25),
    # one CPU core (fp32, AVX2-class), gloo over loopback: rough; calibrate for figures
    DeviceProfile(name="cpu", device="cpu", memory_bytes=16 * GIB,
                  matmul_tflops={"fp32": 0.05}, intra_node=Link(2.0, 1e-4),
                  inter_node=Link(1.0, 2e-4), gpus_per_node=1, hbm_gbps=10.0,
                  h2d_gbps=10.0, d2h_gbps=10.0,
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


def table_peak_tflops(device_name: str, dtype: str = "bf16"
                      ) -> Tuple[Optional[float], Optional[str]]:
    """(data-sheet dense `dtype` peak (bf16 or fp8), the table key it matched) of a device
    name, or (None, None)."""
    d = table_entry_for(device_name)
    if d is None:
        return None, None
    return (d.peak_tflops_fp8 if dtype == "fp8" else d.peak_tflops_bf16), d.match[0]


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
