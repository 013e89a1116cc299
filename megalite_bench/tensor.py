"""Tensor and sequence parallelism: tokens/s and activation memory per rank for tp ∈ {1,2,4},
with and without sequence parallelism, on gloo.

Activation memory is what autograd keeps for backward: every tensor saved during the forward
pass, counted once per storage (q, k, v are views of one QKV output), parameters excluded.
It is measured per transformer layer (one block) and for the whole forward of a micro-batch,
on each rank, and printed next to

    Korthikanti et al. 2022, Table 2 (fp16 activations, 1-byte dropout masks, the attention
    score matrix stored):   TP      sbh(10 + 24/t + 5as/(ht))
                            TP + SP sbh/t · (34 + 5as/h)

and the same derivation for this implementation — e bytes per element (4 in fp32), dropout
off (no masks), fused attention (no a·s² score matrix; its output and log-sum-exp kept):

    TP      e·sbh(4 + 12/t)        TP + SP   e·sbh·16/t
    (+ LayerNorm mean/rstd 4·s'b and attention log-sum-exp a·s·b/t elements; s' = s/t with SP)

elements saved per layer, in units of sbh: the two LayerNorm inputs and the QKV-projection and
fc inputs, 1 each (1/t with SP: the sequence-parallel linear keeps its shard and gathers again
in backward); the QKV output 3/t; the attention output 1/t (the output projection's input is a
view of it); the GELU input and output 4/t each. In 2-byte units that is sbh(8 + 24/t) against
the paper's 10 + 24/t + 5as/(ht): the difference is exactly the dropout masks and the scores.

tokens/s: global tokens per optimizer step over the median step time of the full training step
(forward, backward, optimizer) in a gloo world of tp ranks. On a CPU with fewer cores than ranks
the ranks share cores, so the absolute numbers say little; the memory columns are exact.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

from megalite.config.layout import Layout
from megalite.config.schema import Config, ModelConfig
from megalite.model.gpt2.family import layer_activation_bytes
from megalite.model.gpt2.stage import GPT2
from megalite.model.init import init_parameters
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.rng import RNGTracker
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from megalite.train.build import build_engine


def saved_activation_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def formulas(s: int, b: int, h: int, a: int, t: int, sp: bool, elem: int) -> Dict[str, float]:
    """Korthikanti's bytes per layer (2-byte activations, masks, scores) and this
    implementation's (`megalite.model.gpt2.family.layer_activation_bytes`, `elem` bytes per element)."""
    if sp:
        paper = s * b * h / t * (34 + 5 * a * s / h)
    else:
        paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return {"paper": paper, "ours": layer_activation_bytes(s, b, h, a, t, sp, elem)}


def _measure(rank: int, world: int, cfg: ModelConfig, seq: int, micro_batch: int, steps: int,
             warmup: int) -> List[dict]:
    topo = build_topology(world, 1, 1)
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=g)
    batch = [(w[:, :-1], w[:, 1:])]
    rows = []
    for sp in ([False, True] if world > 1 else [False]):
        rng = RNGTracker(0, rank, 0, 0, device)
        model = GPT2(cfg, topo.tp_group, sp, rng).train()
        init_parameters(model, seed=0)
        engine = build_engine(Config(), Layout.of(topo, sequence_parallel=sp and topo.tp_size > 1),
                              topo, model)
        local_seq = seq // world if sp else seq
        schedule = PipelineSchedule(model.chunks, topo, engine, (local_seq, micro_batch, cfg.n_embd),
                                    torch.float32, device)
        params = list(model.parameters())
        x = model.embed(batch[0][0]).detach().requires_grad_()
        layer = saved_activation_bytes(lambda: model.transformer.h["0"](x), params)
        total = saved_activation_bytes(lambda: model(*batch[0]), params)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            schedule.train_step(batch)
            engine.finish_grad_sync()
            engine.clip_and_step(1e-4, 1.0)
            engine.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        rows.append({"tp": world, "sp": sp, "rank": rank, "layer_bytes": layer,
                     "forward_bytes": total,
                     "tokens_per_s": micro_batch * seq / statistics.median(times),
                     **{f"formula_{k}": v for k, v in formulas(
                         seq, micro_batch, cfg.n_embd, cfg.n_head, world, sp, 4).items()}})
    return rows


def run(args) -> List[dict]:
    cfg = ModelConfig(name="bench", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                      n_positions=args.seq_len, vocab_size=args.vocab_size, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)
    rows = []
    for tp in args.tp:
        per_rank = run_ranks(_measure, tp, args=(cfg, args.seq_len, args.micro_batch,
                                                 args.steps, args.warmup), timeout_s=1800)
        rows += [r for r in per_rank[0]]  # every rank holds the same amounts (equal shards)
    print(f"\nGPT-2 n_layer={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={args.seq_len} "
          f"b={args.micro_batch}, fp32, dropout 0, gloo, 1 thread per rank (megalite.testing.spawn)")
    print(f"{'tp':>3} {'sp':>5} {'tokens/s':>9} {'layer MiB':>10} {'ours formula':>13} "
          f"{'paper formula':>14} {'forward MiB':>12}")
    for r in rows:
        print(f"{r['tp']:>3} {str(r['sp']):>5} {r['tokens_per_s']:>9.0f} "
              f"{r['layer_bytes'] / 2**20:>10.2f} {r['formula_ours'] / 2**20:>13.2f} "
              f"{r['formula_paper'] / 2**20:>14.2f} {r['forward_bytes'] / 2**20:>12.2f}")
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
