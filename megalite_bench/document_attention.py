"""The document mask's kernels side by side (`train.document_kernel`): forward + backward of
`megalite.model.document_attention` by FlexAttention, the variable-length kernel and SDPA with
a boolean mask, on a model's shapes, windows packed with documents of L tokens each, against
the causal kernel (SDPA, is_causal) in the same run; with each kernel's largest error
(outputs and q/k/v gradients) against SDPA's boolean mask in fp32 on the same inputs.

The evidence for train.document_kernel's default (auto = flex): the faster of flex and varlen
at the lengths a corpus has. Kernels that cannot run here (flex and varlen off CUDA) are
listed as such. `work` is the part of the causal (query, key) pairs each computes
(`megalite.plan.document_terms.kernel_work`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from megalite.config.schema import load_config
from megalite.model.attention import grouped_attention
from megalite.model.document_attention import AttentionInputs, document_attention
from megalite.plan.calibrate_mask import document_ids
from megalite.plan.document_terms import kernel_work, work_of
from megalite_bench.timing import alternate

KERNELS = ("flex", "varlen", "sdpa")


def _tensors(b: int, heads: int, kv_heads: int, s: int, d: int, dtype, device) -> List:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (torch.randn(b, h, s, d, generator=g, device=device, dtype=dtype)
                   for h in (heads, kv_heads, kv_heads, heads))
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dy]


def _fwd_bwd(q, k, v, dy, inputs):
    out = grouped_attention(q, k, v, 0.0) if inputs is None else \
        document_attention(q, k, v, inputs, 0.0, "auto")
    return (out, *torch.autograd.grad(out, (q, k, v), dy))


def _errors(data, ids) -> Dict[str, object]:
    """Each kernel's largest relative error against SDPA's boolean mask in fp32 on the timed
    inputs (one compilation of FlexAttention serves both), or why it cannot run here."""
    ref = _fwd_bwd(*[t.detach().float().requires_grad_(t.requires_grad) for t in data],
                   AttentionInputs(ids, kernel="sdpa"))
    out: Dict[str, object] = {}
    for kernel in KERNELS:
        try:
            got = _fwd_bwd(*data, AttentionInputs(ids, kernel=kernel))
        except (RuntimeError, NotImplementedError) as err:  # not here, or out of memory
            out[kernel] = str(err).splitlines()[0][:90]
            continue
        out[kernel] = max(((a.double() - r.double()).norm() / r.double().norm()).item()
                          for a, r in zip(got, ref))
    return out


def _times(data, device, ids, errors: Dict[str, object], args) -> Dict[str, float]:
    """Median fwd+bwd seconds of causal attention and of each kernel that ran, interleaved
    (`alternate`); a kernel that fails while timed is left out."""
    fns = {"causal": lambda: _fwd_bwd(*data, None)}
    for kernel in KERNELS:
        if isinstance(errors[kernel], float):
            inputs = AttentionInputs(ids, kernel=kernel)
            fns[kernel] = lambda inputs=inputs: _fwd_bwd(*data, inputs)
    try:
        return alternate(fns, device, args.warmup, args.steps)
    except (RuntimeError, NotImplementedError) as err:
        print(f"timing all together failed ({str(err).splitlines()[0][:90]}); each alone")
    out = {}
    for name, fn in fns.items():
        try:
            out.update(alternate({name: fn}, device, args.warmup, args.steps))
        except (RuntimeError, NotImplementedError) as err:
            errors[name] = str(err).splitlines()[0][:90]
    return out


def run(args) -> List[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = load_config([f"model={args.preset}"]).model
    b, s, d = args.micro_batch, args.seq_len, m.n_embd // m.n_head
    shape = (b, m.n_head, m.kv_heads, s, d)
    print(f"device={device}, torch {torch.__version__}, {dtype}, {args.preset}: b={b} "
          f"heads={m.n_head}/{m.kv_heads} s={s} d={d}", flush=True)
    data = _tensors(*shape, dtype, device)
    rows = []
    for length in args.document_tokens:
        eos = (np.arange(s) % length == length - 1)[None, :]
        work = work_of(eos, f"documents of {length}")
        ids = document_ids(s, b, length).to(device)
        errors = _errors(data, ids)
        times = _times(data, device, ids, errors, args)
        for kernel in KERNELS:
            t = times.get(kernel)
            rows.append({"document_tokens": length, "kernel": kernel,
                         "work": kernel_work(work, kernel),
                         "ms": None if t is None else t * 1e3,
                         "vs_causal": None if t is None or "causal" not in times
                         else t / times["causal"],
                         "max_rel_error": errors[kernel]})
        ran = [r for r in rows[-len(KERNELS):] if r["ms"] is not None]
        if ran:
            print(f"L={length}: fastest {min(ran, key=lambda r: r['ms'])['kernel']}")
    _print(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


def _print(rows: List[dict]) -> None:
    print(f"\n{'L':>6} {'kernel':<7} {'work':>6} {'fwd+bwd ms':>10} {'/causal':>8} {'rel err':>9}")
    for r in rows:
        err = r["max_rel_error"]
        err = f"{err:9.1e}" if isinstance(err, float) else f"  not here: {err}"
        ms = f"{r['ms']:10.3f} {r['vs_causal']:8.2f}" if r["ms"] is not None else f"{'-':>19}"
        print(f"{r['document_tokens']:>6} {r['kernel']:<7} {r['work']:6.1%} {ms} {err}")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--document-tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
