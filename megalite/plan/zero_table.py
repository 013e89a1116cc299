"""The ZeRO table (Rajbhandari et al. 2019 §5): what each stage shards and sends per rank; and
zero 2/3's gradient staging bytes (`grad_staging_bytes`, from the parameters' sizes in the
model's registration order, `chunk_param_sizes`, over the engine's buckets or units).

The one home of this table: the plan's bytes (`megalite.plan.memory`), the engine tests and
the docs' table (tests/unit/test_docs.py checks it equals `zero_table()`) are drawn from it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.parallel.bucket import REDUCTIONS_IN_FLIGHT
from megalite.parallel.zero import bucket_groups
from megalite.plan.chunks import ChunkEnds
from megalite.plan.dims import Dims

ZERO_DP_TRAFFIC = {  # DP ring traffic per step, in parameter elements (Ψ; ×4 bytes on the wire)
    0: "all-reduce: 2Ψ·(N−1)/N elements",
    1: "reduce-scatter + all-gather: 2Ψ·(N−1)/N",
    2: "(m + 1)Ψ·(N−1)/N",
    3: "3mΨ·(N−1)/N",
}


def model_state_bytes(layout: Layout, psi: float, e: int) -> Dict[str, float]:
    """Bytes one rank holds for Ψ parameter elements: parameters e·Ψ, gradients 4·Ψ (fp32
    accumulation), optimizer 8·Ψ (AdamW moments) + 4·Ψ (fp32 master where e < 4); each
    divided by N where the ZeRO stage shards it (`Layout.shards_*`)."""
    def shard(sharded: bool) -> int:
        return layout.dp_size if sharded else 1

    return {"params": e * psi / shard(layout.shards_parameters),
            "grads": 4 * psi / shard(layout.shards_gradients),
            "optimizer": (8 + (4 if e < 4 else 0)) * psi / shard(layout.shards_optimizer)}


def dp_traffic_elements(layout: Layout, psi: float, m: int) -> float:
    """DP ring elements one rank sends per step (ZERO_DP_TRAFFIC, reshard after forward)."""
    n = layout.dp_size
    ring = (n - 1) / n * psi
    return {0: 2 * ring, 1: 2 * ring, 2: (m + 1) * ring, 3: 3 * m * ring}[layout.zero_stage]


def zero_table() -> str:
    """The table of docs/zero.md, rendered from `model_state_bytes` and `ZERO_DP_TRAFFIC`."""
    def formula(layout: Layout, e: int) -> str:
        parts = model_state_bytes(layout, 1, e)
        return " + ".join(f"{round(v * (layout.dp_size if v < 1 else 1))}Ψ"
                          + ("/N" if v < 1 else "") for v in parts.values())

    rows = ["| zero | parameters | gradients | optimizer | CUDA bytes | CPU bytes "
            "| DP traffic per step (ring) |", "|---|---|---|---|---|---|---|"]
    for zero in range(4):
        big = Layout(dp_size=1 << 20, zero_stage=zero)  # N large: sharded states show as /N
        share = ["1/N" if x else "full" for x in (big.shards_parameters, big.shards_gradients,
                                                  big.shards_optimizer)]
        rows.append(f"| {zero} | {' | '.join(share)} | {formula(big, 2)} | {formula(big, 4)} "
                    f"| {ZERO_DP_TRAFFIC[zero]} |")
    return "\n".join(rows)


def chunk_param_sizes(d: Dims, first: bool, last: bool, n: int,
                      head_copy: Optional[bool] = None, tied: bool = True
                      ) -> List[Tuple[str, int, bool]]:
    """(name, elements on one TP rank, tied) of a chunk's parameters in GPT2's registration
    order (what the engine buckets; a test holds it to the model). `head_copy`: the LM head
    is a parameter of its own (default: last and not first); `tied`: the embedding's spec is
    tied (not zb-v's stage 0, where head and embedding are one parameter)."""
    m, tp = d.cfg.model, d.layout.tp_size
    h, f, v = m.n_embd, m.ffn_size, d.vocab // tp
    sizes = [("wte", v * h, tied), ("wpe", m.n_positions * h, False)] if first else []
    block = [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h, f * h // tp, f // tp,
             h * f // tp, h]
    sizes += [(f"h{i}.{j}", size, False) for i in range(n) for j, size in enumerate(block)]
    if last:
        sizes += [("ln_f.w", h, False), ("ln_f.b", h, False)]
        copy = not first if head_copy is None else head_copy
        sizes += [("lm_head", v * h, True)] if copy else []
    return sizes


def grad_staging_bytes(d: Dims, chunks: List[Tuple[ChunkEnds, int]]) -> float:
    """Zero 2/3's full-size fp32 gradient staging (`ZeroEngine.grad_staging_bytes`): the
    largest bucket (zero 3: unit) padded to N, REDUCTIONS_IN_FLIGHT + 1 of them. `chunks`:
    (`megalite.plan.chunks.ChunkEnds`, blocks) per chunk of the stage."""
    lay = d.layout
    if not lay.shards_gradients:
        return 0.0
    largest = 0
    for ends, n in chunks:
        first, last, head_copy = ends.first, ends.last, ends.head_copy
        sizes = chunk_param_sizes(d, first, last, n, head_copy, ends.tied)
        if lay.shards_parameters:  # units: wte, wpe, each block, ln_f, the LM head
            h, vocab = d.cfg.model.n_embd, d.vocab // lay.tp_size * d.cfg.model.n_embd
            numels = ([vocab, d.cfg.model.n_positions * h] if first else []) \
                + ([d.layer_params] if n else []) + ([2 * h] if last else []) \
                + ([vocab] if head_copy else [])
        else:
            by_name = dict((name, s) for name, s, _ in sizes)
            groups = bucket_groups(sizes, d.cfg.parallel.bucket_mb * 2**20 / 4,
                                   tied_alone=lay.pp_size > 1)
            numels = [sum(by_name[name] for name in g) for g in groups]
        largest = max(largest, max(numels))
    dp = lay.dp_size
    return (REDUCTIONS_IN_FLIGHT + 1) * 4 * max(dp, -(-largest // dp) * dp)
