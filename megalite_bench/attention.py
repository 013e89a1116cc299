"""Causal attention kernels side by side on a model's shapes: forward + backward time of
`F.scaled_dot_product_attention` under each SDPA backend (flash, cuDNN, memory-efficient, math),
with the error of output and input gradients against the math kernel in fp32.

The evidence for choosing `train.attention` (`megalite.model.attention`). FLOPs counted as
the causal kernels do the work: forward 2·b·a·s²·d (QKᵀ and AV, half the square), backward
2.5× forward (FlashAttention-2's count, with the recomputed scores); TFLOP/s = that / time.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from megalite.config.schema import load_config
from megalite.model.attention import BACKENDS
from megalite_bench.timing import timed


def _inputs(b: int, heads: int, s: int, d: int, dtype, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=g, device=device, dtype=dtype)
            for _ in range(4)]  # q, k, v, dy


def _fwd_bwd(q, k, v, dy, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.backward(dy)
    return y, q.grad, k.grad, v.grad


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def run(args) -> List[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f"), torch {torch.__version__}, dtype={dtype}", flush=True)
    results = []
    for preset in args.presets:
        m = load_config([f"model={preset}"]).model
        b, heads, s, d = args.micro_batch, m.n_head, min(args.seq_len, m.n_positions), m.n_embd // m.n_head
        flops = 2 * b * heads * s * s * d * 3.5
        check = _inputs(min(b, 2), heads, s, d, dtype, device, seed=1)  # fresh data for errors
        ref = _fwd_bwd(*(t.float() for t in check), BACKENDS["math"])
        base: Optional[float] = None
        for name in args.backends:
            try:
                errors = [_rel(a, r) for a, r in zip(_fwd_bwd(*check, BACKENDS[name]), ref)]
                data = [_inputs(b, heads, s, d, dtype, device, seed=10 + i) for i in range(3)]
                for i in range(args.warmup):
                    _fwd_bwd(*data[i % 3], BACKENDS[name])
                times = [timed(lambda: _fwd_bwd(*data[i % 3], BACKENDS[name]), device)
                         for i in range(args.steps)]
            except RuntimeError as err:  # the backend cannot run these inputs here
                print(f"{preset} {name}: not available ({str(err).splitlines()[0][:100]})")
                continue
            t = statistics.median(times)
            base = base or t
            row: Dict = {"preset": preset, "backend": name, "shape": [b, heads, s, d],
                         "ms": t * 1e3, "tflops": flops / t / 1e12, "speedup": base / t,
                         "max_rel_error": max(errors)}
            results.append(row)
    print(f"\n{'preset':<8} {'backend':<10} {'b,a,s,d':<18} {'fwd+bwd ms':>10} {'TFLOP/s':>8} "
          f"{'speed vs first':>14} {'rel err':>8}")
    for r in results:
        print(f"{r['preset']:<8} {r['backend']:<10} {','.join(map(str, r['shape'])):<18} "
              f"{r['ms']:>10.3f} {r['tflops']:>8.2f} {r['speedup']:>14.2f} "
              f"{r['max_rel_error']:>8.1e}")
    return results


def add_arguments(parser) -> None:
    parser.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-xl"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS),
                        help="the first one is the base of the speed ratios")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
