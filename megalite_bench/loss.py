"""The loss alone, forward + backward: the fp32 cross-entropy megalite used before
(`F.cross_entropy(logits[:, :V].float(), targets)`) against the chunked one
(`megalite.parallel.cross_entropy`), on logits [N, V padded] of a large vocabulary.

Per path: the bytes its forward saves for backward, the peak live bytes of its forward and
of forward + backward (tensors allocated by the loss: the logits themselves, made before,
are not counted; the gradient of the logits is), both measured (`megalite_bench.memory`:
the profiler's allocation events on the CPU, the caching allocator's peak on a GPU) and as
the memory plan counts them (`megalite.plan.dims.loss_bytes`; the old path: three fp32
[N, V] buffers at its backward), and the median time of forward + backward (the paths'
calls interleaved).

    megalite-bench loss                                  # N = 8,192, V = 50,257, bf16
    megalite-bench loss --tokens 16384 --dtype bf16 --device cuda
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from megalite.parallel.cross_entropy import chunk_rows, cross_entropy
from megalite.parallel.group import single_rank_group
from megalite.parallel.param_spec import padded_vocab_size
from megalite.plan.dims import loss_bytes
from megalite_bench.memory import PeakBytes
from megalite_bench.tensor import saved_activation_bytes
from megalite_bench.timing import alternate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fp32_loss_bytes(tokens: int, vocab: int) -> Dict[str, float]:
    """The old path's bytes as a plan should have counted them (eager): it saves the fp32
    log-probabilities [N, V]; its forward holds the fp32 copy of the logits and the
    log-probabilities (on an H100 measured 2.5 of these: 8.238e9 bytes at N = 16,384,
    V = 50,257); its backward the saved log-probabilities, the NLL gradient and log_softmax's
    backward output: three fp32 [N, V] (the gradients of the cast and of the slice, e bytes
    [N, V] and [N, padded], come after the fp32 ones are freed)."""
    full = 4 * tokens * vocab
    return {"saved": full, "forward": 2 * full, "peak": 3 * full}


def _paths(vocab: int) -> Dict[str, Callable]:
    group = single_rank_group("tp")
    return {
        "F.cross_entropy(logits.float())": lambda z, t: F.cross_entropy(z[:, :vocab].float(), t),
        "chunked": lambda z, t: cross_entropy(z, t, group, 0, vocab).mean(),
    }


def measure(loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor
            ) -> Dict[str, float]:
    """Saved bytes, forward peak and forward + backward peak: bytes the loss allocates."""
    x = logits.detach().requires_grad_()
    saved = saved_activation_bytes(lambda: loss_fn(x, targets), [x])
    with PeakBytes(x.device) as fwd:
        loss = loss_fn(x, targets)
    del loss
    with PeakBytes(x.device) as both:
        loss_fn(x, targets).backward()
    return {"saved": saved, "forward": fwd.bytes, "peak": both.bytes}


def _step(loss_fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> Callable:
    x = logits.detach().requires_grad_()

    def step():
        loss_fn(x, targets).backward()
        x.grad = None
    return step


def run(args) -> List[dict]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    n, vocab = args.tokens, args.vocab
    padded = padded_vocab_size(vocab, 1)
    e = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(n, padded, generator=g, device=device) * 2).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g, device=device)
    planned = {"F.cross_entropy(logits.float())": fp32_loss_bytes(n, vocab)}
    new, logits_bytes = loss_bytes(n, padded, e, tp=1), e * n * padded
    saved = new["saved"] - logits_bytes  # beyond the logits
    planned["chunked"] = {"saved": saved, "forward": saved + new["forward"],
                          "peak": saved + new["backward"]}
    print(f"device={device}, torch {torch.__version__}, {args.dtype} logits [{n:,}, {padded:,}] "
          f"({vocab:,} real columns), {e * n * padded / 1e9:.3f} GB; chunk "
          f"{min(chunk_rows(padded), n):,} tokens x {padded:,} columns; bytes beyond the "
          "logits: measured (planned)", flush=True)
    print(f"{'path':<34} {'saved GB':>16} {'forward peak GB':>18} {'fwd+bwd peak GB':>18} "
          f"{'ms':>8}")
    paths = _paths(vocab)
    seconds = alternate({name: _step(fn, logits, targets) for name, fn in paths.items()},
                        device, warmup=1, steps=args.reps)
    results = []
    for name, fn in paths.items():
        got = {**measure(fn, logits, targets), "seconds": seconds[name]}
        want = planned[name]
        print(f"{name:<34} " + " ".join(
            f"{got[k] / 1e9:>8.3f} ({want[k] / 1e9:.3f})".rjust(w)
            for k, w in (("saved", 16), ("forward", 18), ("peak", 18)))
            + f" {got['seconds'] * 1e3:>8.1f}", flush=True)
        results.append({"path": name, **got, "planned": want})
    return results


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=8192, help="N = sequence x micro-batch")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=4, help="timed calls of each path, "
                        "interleaved (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
