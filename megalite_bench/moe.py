"""Mixture-of-Experts side by side, in one run on this machine (ratios, not absolute times):

  step   training steps, all arms alternated step by step (A B C ... C B A, `alternate`) on
         the same batches: megalite's MoE model (mixtral-tiny) with its experts as grouped
         GEMM and as the per-expert loop, its dense Llama of the same active parameters (the
         MLP top_k experts wide), and transformers' MixtralForCausalLM of the same shape with
         experts_implementation eager and grouped_mm (where this transformers offers it).
         Both sides optimise the same objective: the LM loss + transformers' aux loss
         (model.moe.aux_loss=hf, no z-loss). fp32 on CPU; on CUDA megalite's bf16 parameters
         and fp32 master weights against transformers under bf16 autocast.
  layer  one MoE layer's forward + backward on `--layer-tokens` tokens, grouped GEMM
         (torch._grouped_mm) against the loop, the same weights: their largest relative
         difference is asserted (fp32: 1e-5; bf16 on CUDA: 2e-2) before either is timed.

Each of `--repeats` rounds times `--steps` alternated calls after `--warmup` (the first round
only); a figure is the median over rounds of each round's median, a ratio the median of each
round's ratio (with its range over rounds). The machine's load average is printed before and
after (a shared machine's drift hits every arm alike, not its absolute time).

    megalite-bench moe --repeats 3 --steps 4 --out moe.json
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Callable, Dict, List

import torch

from megalite.model.families import family
from megalite_bench.moe_arms import (
    auto_impl,
    layer_pair,
    megalite_moe_step,
    model_configs,
    transformers_experts_implementations,
    transformers_step,
)
from megalite_bench.timing import alternate
from megalite_bench.train import random_batches

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def step_ratios(auto: str) -> list:
    """(the ratio's name, numerator arm, denominator arm): tokens/s of one over the other;
    megalite's MoE is the arm its default (experts_impl=auto) runs here, `auto`."""
    moe = f"megalite moe {auto}"
    return [("moe / dense (megalite)", moe, "megalite dense"),
            ("megalite / transformers eager", moe, "transformers eager"),
            ("megalite / transformers grouped_mm", moe, "transformers grouped_mm"),
            ("megalite grouped / transformers grouped_mm", "megalite moe grouped",
             "transformers grouped_mm"),
            ("megalite grouped / loop", "megalite moe grouped", "megalite moe loop")]


def _rounds(fns: Dict[str, Callable[[], object]], device, args) -> List[Dict[str, float]]:
    """Each round's median seconds per call of every function (warmup in the first round)."""
    return [alternate(fns, device, args.warmup if r == 0 else 0, args.steps)
            for r in range(args.repeats)]


def _summary(rounds: List[Dict[str, float]], ratios, per_call: float) -> dict:
    """Per arm the median seconds and calls/s (times `per_call`: tokens); per ratio
    (numerator's speed over the denominator's) the median and range over rounds."""
    arms = {n: statistics.median(r[n] for r in rounds) for n in rounds[0]}
    out = {"arms": {n: {"s": s, "per_s": per_call / s} for n, s in arms.items()},
           "ratios": {}}
    for name, num, den in ratios:
        if num in arms and den in arms:
            each = [r[den] / r[num] for r in rounds]
            out["ratios"][name] = {"median": statistics.median(each), "min": min(each),
                                   "max": max(each)}
    return out


def step_arms(args, device, not_run: Dict[str, str]) -> Dict[str, Callable[[], object]]:
    """Each training-step arm's call on the same batches; an arm whose first step fails
    here is left out, its error in `not_run`."""
    moe_cfg, dense_cfg = model_configs(args)
    batches = random_batches(moe_cfg.vocab_size, args.micro_batch, args.seq_len,
                             args.micro_batches, device)
    makers = {"megalite dense": lambda: megalite_moe_step(dense_cfg, device, args.micro_batch,
                                                          args.seq_len, "auto")}
    for impl in ("grouped", "loop"):
        makers[f"megalite moe {impl}"] = (lambda i: lambda: megalite_moe_step(
            moe_cfg, device, args.micro_batch, args.seq_len, i))(impl)
    if args.reference:
        for impl in transformers_experts_implementations():
            makers[f"transformers {impl}"] = (
                lambda i: lambda: transformers_step(moe_cfg, device, i))(impl)
    fns = {}
    for name, make in makers.items():
        try:  # one untimed step: an arm that cannot run here is named, not timed
            step = make()
            step(batches)
        except (RuntimeError, NotImplementedError) as err:
            not_run[name] = str(err).splitlines()[0][:120]
            continue
        fns[name] = (lambda s: lambda: s(batches))(step)
    return fns


def measure_layer(args, device, dtype) -> dict:
    """The MoE layer's fwd+bwd, grouped GEMM against the loop, once their numbers agree."""
    moe_cfg, _ = model_configs(args)
    fns, rel = layer_pair(moe_cfg, device, dtype, args.layer_tokens)
    if not rel <= TOLERANCE[dtype]:  # checked before timing, under python -O too
        raise AssertionError(f"grouped GEMM and the loop differ: {rel:.2e} relative (at most "
                             f"{TOLERANCE[dtype]:.0e} in {dtype})")
    got = _summary(_rounds(fns, device, args), [("grouped / loop", "grouped", "loop")],
                   args.layer_tokens)
    return {"dtype": str(dtype).replace("torch.", ""), "tokens": args.layer_tokens,
            "max_rel_difference": rel, **got}


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe_cfg, dense_cfg = model_configs(args)
    import transformers

    result = {"device": str(device), "torch": torch.__version__,
              "transformers": transformers.__version__, "threads": torch.get_num_threads(),
              "cores": os.cpu_count(), "load_before": os.getloadavg()[0],
              "model": moe_cfg.name, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
              "micro_batches": args.micro_batches, "repeats": args.repeats,
              "steps": args.steps, "params": {
                  "moe_total": family(moe_cfg).num_parameters(moe_cfg),
                  "moe_active": family(moe_cfg).active_parameters(moe_cfg),
                  "dense": family(dense_cfg).num_parameters(dense_cfg)}}
    print(_header(result), flush=True)
    tokens = args.micro_batch * args.seq_len * args.micro_batches
    result["auto"] = auto_impl(moe_cfg, device, dtype)
    result["not_run"] = {}
    result["step"] = _summary(_rounds(step_arms(args, device, result["not_run"]), device, args),
                              step_ratios(result["auto"]), tokens)
    result["layer"] = measure_layer(args, device, dtype)
    result["load_after"] = os.getloadavg()[0]
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def _header(r: dict) -> str:
    p = r["params"]
    return (f"device={r['device']}, torch {r['torch']}, transformers {r['transformers']}, "
            f"{r['threads']} threads on {r['cores']} cores, load average "
            f"{r['load_before']:.1f}\n{r['model']}: {p['moe_total'] / 1e6:.2f}M parameters, "
            f"{p['moe_active'] / 1e6:.2f}M active; dense: {p['dense'] / 1e6:.2f}M; micro-batch "
            f"{r['micro_batch']} x {r['micro_batches']}, seq {r['seq_len']}, {r['repeats']} "
            f"rounds x {r['steps']} steps per arm")


def _print(r: dict) -> None:
    step, layer = r["step"], r["layer"]
    print(f"\nmegalite's default here (experts_impl=auto): {r['auto']}")
    print(f"\n{'training step':<34} {'s/step':>8} {'tokens/s':>10}")
    for name, a in step["arms"].items():
        print(f"{name:<34} {a['s']:>8.3f} {a['per_s']:>10.0f}")
    for name, why in r["not_run"].items():
        print(f"{name:<34} not here: {why}")
    print(f"\nMoE layer fwd+bwd, {layer['tokens']} tokens, {layer['dtype']} "
          f"(grouped vs loop: {layer['max_rel_difference']:.1e} relative)")
    for name, a in layer["arms"].items():
        print(f"{name:<34} {a['s'] * 1e3:>8.2f} ms")
    print(f"\n{'ratio (tokens/s)':<42} {'median':>8} {'range':>14}")
    for name, q in {**step["ratios"], **{f"layer {k}": v for k, v in
                                         layer["ratios"].items()}}.items():
        print(f"{name:<42} {q['median']:>8.2f} {q['min']:>6.2f}-{q['max']:<7.2f}")
    print(f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="mixtral-tiny", help="an MoE model preset")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2 moe.top_k=1")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=1, help="per optimizer step")
    parser.add_argument("--layer-tokens", type=int, default=2048,
                        help="tokens of the MoE layer's fwd+bwd (grouped vs loop)")
    parser.add_argument("--steps", type=int, default=4, help="timed calls per arm per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument("--reference", type=int, default=1, choices=[0, 1],
                        help="0: leave transformers' Mixtral out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
