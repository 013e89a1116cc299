"""Device profile files: what `scripts/plan.py --calibrate` measured on a machine, for the planner.

    {"format": "megalite-device-profile", "version": 1,
     "name": str, "device": str, "memory_bytes": int, "gpus_per_node": int,
     "matmul_tflops": {"bf16"|"fp16"|"fp32"|"fp8": float},   # achievable, the dtypes measured
     "links": {"intra_node": {"bus_gbps": float, "latency_s": float},
               "inter_node": {"bus_gbps": float, "latency_s": float}},
     "op_links": {"intra_node": {op: {"bus_gbps", "latency_s"}}, "inter_node": {...}},
                                      # optional: the same fit per collective kind (OPS)
     "sweep": [{"op", "group_size", "bytes", "seconds", "bus_gbps"}, ...],
     "matmul_sweep": [{"m", "n", "k", "dtype", "tflops"}, ...],
     "notes": [str, ...],                                      # optional: what was measured how
     "block_overhead": {"fixed_s": float, "per_token_s": float, "n_embd": int,
                        "dropout": float, "compiled": bool, ...},  # optional: a block's
                                      # forward + backward beyond its matmul FLOPs (seconds a
                                      # pass and a token; megalite/plan/calibrate_block.py;
                                      # dropout and compiled: optional, files before them
                                      # did not record them)
     "document_mask": [{"kernel": "flex" | "varlen" | "sdpa", "ratio": float, ...}, ...],
                                      # optional (one object in older files): each measured
                                      # masked attention's time per unit of its work over the
                                      # causal attention at the matmul rate
                                      # (megalite/plan/calibrate_mask.py)
     "hbm_gbps": float,                                        # optional (CUDA): device copy
     "host_link": {"h2d_gbps": float, "d2h_gbps": float},      # optional (CUDA): pinned copies
     "host_adam": {"params_per_s": float, "threads": int},     # optional (CUDA): a node's host
                                      # AdamW (megalite/plan/calibrate_host.py)
     "crc32": int}

Bandwidths are bus bandwidths in GB/s (1e9 bytes/s) as nccl-tests defines them: the algorithm
bandwidth (bytes / seconds) times 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter (bytes = the full, unsharded buffer), 1 for send/recv. `crc32` is zlib's CRC-32 of
the canonical JSON (sorted keys, no spaces) of every other key: a file changed after it was
written is refused, as is a file of another format or version, rather than planned with.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, Dict, Union

from megalite.config.document_kernel import MEASURED_KERNELS
from megalite.utils.durable import fsync_dir

FORMAT = "megalite-device-profile"
VERSION = 1
DTYPES = ("bf16", "fp16", "fp32", "fp8")  # fp8: torch._scaled_mm, e4m3 operands
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
LINKS = ("intra_node", "inter_node")


class ProfileError(ValueError):
    """A device profile file that cannot be used; the message names the file and the fault."""


def profile_crc32(profile: Dict[str, Any]) -> int:
    body = {k: v for k, v in profile.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rate(value: Any) -> bool:
    """A finite number > 0 (a bool is not a number here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _problems_of_entry(where: str, entry: Any, ints: tuple, rates: tuple) -> list:
    if not isinstance(entry, dict):
        return [f"{where}: must be an object, got {entry!r}"]
    out = [f"{where}.{k}={entry.get(k)!r}: must be a positive integer"
           for k in ints if not (_is_int(entry.get(k)) and entry.get(k) > 0)]
    out += [f"{where}.{k}={entry.get(k)!r}: must be a finite number > 0"
            for k in rates if not _is_rate(entry.get(k))]
    return out


def _problems_of_links(links: Any, names: tuple = LINKS) -> list:
    if not isinstance(links, dict):
        return [f"links={links!r}: must be an object with {' and '.join(LINKS)}"]
    out = []
    for name in names:
        link = links.get(name)
        if not isinstance(link, dict):
            out.append(f"links.{name}={link!r}: must be an object with bus_gbps and latency_s")
            continue
        if not _is_rate(link.get("bus_gbps")):
            out.append(f"links.{name}.bus_gbps={link.get('bus_gbps')!r}: must be a finite "
                       "number > 0 (GB/s)")
        lat = link.get("latency_s")
        if not (isinstance(lat, (int, float)) and not isinstance(lat, bool)
                and math.isfinite(lat) and lat >= 0):
            out.append(f"links.{name}.latency_s={lat!r}: must be a finite number >= 0 (seconds)")
    return out


def _problems_of_sweeps(profile: Dict[str, Any]) -> list:
    out = []
    sweep, matmuls = profile.get("sweep"), profile.get("matmul_sweep")
    if not isinstance(sweep, list):
        out.append(f"sweep={sweep!r}: must be a list (empty when no link was measured)")
    else:
        for i, e in enumerate(sweep):
            out += _problems_of_entry(f"sweep[{i}]", e, ("group_size", "bytes"),
                                      ("seconds", "bus_gbps"))
            if isinstance(e, dict) and e.get("op") not in OPS:
                out.append(f"sweep[{i}].op={e.get('op')!r}: must be one of {', '.join(OPS)}")
    if not isinstance(matmuls, list) or not matmuls:
        return out + [f"matmul_sweep={matmuls!r}: must be a non-empty list"]
    for i, e in enumerate(matmuls):
        out += _problems_of_entry(f"matmul_sweep[{i}]", e, ("m", "n", "k"), ("tflops",))
        if isinstance(e, dict) and e.get("dtype") not in DTYPES:
            out.append(f"matmul_sweep[{i}].dtype={e.get('dtype')!r}: must be one of "
                       f"{', '.join(DTYPES)}")
    return out


def profile_problems(profile: Dict[str, Any]) -> list:
    """Every missing or ill-typed field of a profile (format and version aside), as messages."""
    out = [f"{k}={profile.get(k)!r}: must be a non-empty string"
           for k in ("name", "device")
           if not (isinstance(profile.get(k), str) and profile.get(k))]
    for key, least in (("memory_bytes", 1), ("gpus_per_node", 1)):
        if not (_is_int(profile.get(key)) and profile[key] >= least):
            out.append(f"{key}={profile.get(key)!r}: must be a positive integer")
    out += _problems_of_rates(profile.get("matmul_tflops"))
    out += _problems_of_links(profile.get("links"))
    out += _problems_of_op_links(profile.get("op_links"))
    out += _problems_of_sweeps(profile)
    out += _problems_of_block(profile.get("block_overhead"))
    out += _problems_of_mask(profile.get("document_mask"))
    if "hbm_gbps" in profile and not _is_rate(profile["hbm_gbps"]):
        out.append(f"hbm_gbps={profile['hbm_gbps']!r}: must be a finite number > 0 (GB/s)")
    if "host_link" in profile:
        out += _problems_of_entry("host_link", profile["host_link"], (),
                                  ("h2d_gbps", "d2h_gbps"))
    if "host_adam" in profile:
        out += _problems_of_entry("host_adam", profile["host_adam"], ("threads",),
                                  ("params_per_s",))
    notes = profile.get("notes", [])
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        out.append(f"notes={notes!r}: must be a list of strings")
    return out


def _problems_of_rates(rates: Any) -> list:
    """matmul_tflops: a non-empty map of known dtypes to positive TFLOP/s."""
    if not isinstance(rates, dict) or not rates:
        return [f"matmul_tflops={rates!r}: must map one or more of {', '.join(DTYPES)} "
                "to TFLOP/s"]
    return [f"matmul_tflops has {k!r}: must be one of {', '.join(DTYPES)}"
            for k in rates if k not in DTYPES] \
        + [f"matmul_tflops.{k}={v!r}: must be a finite number > 0 (TFLOP/s)"
           for k, v in rates.items() if not _is_rate(v)]


def _problems_of_op_links(op_links: Any) -> list:
    """op_links (optional): per link, fits per collective kind."""
    if op_links is None:
        return []
    if not isinstance(op_links, dict) or set(op_links) - set(LINKS):
        return [f"op_links={op_links!r}: must map {' and/or '.join(LINKS)} to fits per "
                "collective kind"]
    out = []
    for name, ops in op_links.items():
        if not isinstance(ops, dict) or set(ops) - set(OPS):
            out.append(f"op_links.{name}={ops!r}: must map some of {', '.join(OPS)} "
                       "to {bus_gbps, latency_s}")
            continue
        out += [p.replace("links.", f"op_links.{name}.", 1)
                for p in _problems_of_links(ops, names=tuple(ops))]
    return out


def _problems_of_block(block: Any) -> list:
    """block_overhead (optional): the measured block's fit."""
    if block is None:
        return []
    if not isinstance(block, dict):
        return [f"block_overhead={block!r}: must be an object with fixed_s and per_token_s"]
    out = [f"block_overhead.{k}={block.get(k)!r}: must be a finite number >= 0 (seconds)"
           for k in ("fixed_s", "per_token_s")
           if not (_is_rate(block.get(k)) or block.get(k) == 0)]
    if not (_is_int(block.get("n_embd")) and block["n_embd"] > 0):
        out.append(f"block_overhead.n_embd={block.get('n_embd')!r}: must be a positive "
                   "integer (the measured block's width)")
    drop = block.get("dropout", 0.0)
    if not (_is_rate(drop) or drop == 0) or drop >= 1:
        out.append(f"block_overhead.dropout={drop!r}: must be a number in [0, 1)")
    if not isinstance(block.get("compiled", False), bool):
        out.append(f"block_overhead.compiled={block.get('compiled')!r}: must be true or false")
    return out


def _mask_entries(mask: Any) -> list:
    """document_mask's entries: one object (files of one kernel) or a list of them."""
    return mask if isinstance(mask, list) else [mask]


def _problems_of_mask(mask: Any) -> list:
    """document_mask (optional): each measured masked attention kernel and its ratio."""
    if mask is None:
        return []
    out, seen = [], set()
    for entry in _mask_entries(mask):
        if not isinstance(entry, dict) or entry.get("kernel") not in MEASURED_KERNELS:
            out.append(f"document_mask={entry!r}: must be an object with kernel (flex, varlen "
                       "or sdpa) and ratio, or a list of them")
            continue
        if entry["kernel"] in seen:
            out.append(f"document_mask: kernel {entry['kernel']!r} is measured twice; keep one")
        seen.add(entry["kernel"])
        ratio = entry.get("ratio")
        if not (_is_rate(ratio) or ratio == 0):
            out.append(f"document_mask.ratio={ratio!r}: must be a finite number >= 0")
    return out


def mask_ratios_of(mask: Any) -> Dict[str, float]:
    """{kernel: ratio} of a checked profile's document_mask (empty where absent)."""
    return {} if mask is None else {e["kernel"]: float(e["ratio"]) for e in _mask_entries(mask)}


def _check_identity(path: Path, profile: Any) -> None:
    """Refuse a file that is not a megalite device profile of this version."""
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        found = profile.get("format") if isinstance(profile, dict) else type(profile).__name__
        raise ProfileError(f"{path}: not a megalite device profile (format={found!r}, expected "
                           f"{FORMAT!r}); make one with scripts/plan.py --calibrate")
    if profile.get("version") != VERSION:
        raise ProfileError(f"{path}: device profile version {profile.get('version')!r}; this "
                           f"megalite reads version {VERSION}: recalibrate with "
                           "scripts/plan.py --calibrate")


def load_profile(path: Union[str, Path]) -> Dict[str, Any]:
    """The profile in `path`, checked: JSON, format and version, CRC, then every field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the device profile ({e.strerror})") from e
    try:
        profile = json.loads(text, parse_constant=lambda c: float("nan"))
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: damaged device profile, not valid JSON ({e}); a truncated "
                           "or partly written file reads so: recalibrate") from e
    _check_identity(path, profile)
    stored = profile.get("crc32")
    if not _is_int(stored):
        raise ProfileError(f"{path}: damaged device profile: crc32={stored!r} is missing or not "
                           "an integer")
    actual = profile_crc32(profile)
    if stored != actual:
        raise ProfileError(f"{path}: damaged device profile: CRC32 mismatch (stored {stored}, "
                           f"content {actual}): the file changed after it was written; "
                           "recalibrate rather than edit it")
    problems = profile_problems(profile)
    if problems:
        raise ProfileError(f"{path}: invalid device profile: " + "; ".join(problems))
    return profile


def save_profile(path: Union[str, Path], profile: Dict[str, Any]) -> Dict[str, Any]:
    """Write `profile` (format, version and crc32 filled in) to `path` atomically: a temporary
    file in the same directory, flushed to disk, renamed over `path`, the directory flushed. A
    crash leaves the old file or the new one, never a partial one. Returns what was written."""
    path = Path(path)
    body = {"format": FORMAT, "version": VERSION,
            **{k: v for k, v in profile.items() if k not in ("format", "version", "crc32")}}
    problems = profile_problems(body)
    if problems:
        raise ProfileError(f"refusing to write {path}: " + "; ".join(problems))
    body["crc32"] = profile_crc32(body)
    text = json.dumps(body, indent=1, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return body
