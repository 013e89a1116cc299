"""The ZeRO table (Rajbhandari et al. 2019 §5): what each stage shards and sends per rank; and
zero 2/3's gradient staging bytes (`grad_staging_bytes`, from the parameters' sizes in the
model's registration order, `chunk_param_sizes`, over the engine's buckets or units).

The one home of this table: the plan's bytes (`megalite.plan.memory`), the engine tests and
the docs' table (tests/unit/project/test_docs.py checks it equals `zero_table()`) are drawn from it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.parallel.bucket import REDUCTIONS_IN_FLIGHT, bucket_groups
from megalite.plan.chunks import ChunkEnds
from megalite.plan.dims import Dims

ZERO_DP_TRAFFIC = {  # DP ring traffic per step, in parameter elements (Ψ; ×4 bytes on the wire)
    0: "all-reduce: 2Ψ·(N−1)/N elements",
    1: "reduce-scatter + all-gather: 2Ψ·(N−1)/N",
    2: "(m + 1)Ψ·(N−1)/N",
    3: "3mΨ·(N−1)/N",
}


def model_state_bytes(layout: Layout, psi: float, e: int, replicas: Optional[int] = None
                      ) -> Dict[str, float]:
    """Bytes one rank holds for Ψ parameter elements: parameters e·Ψ, gradients 4·Ψ (fp32
    accumulation), optimizer 8·Ψ (AdamW moments) + 4·Ψ (fp32 master where e < 4); each
    divided by N = DP x CP (`Layout.grad_replicas`: the ranks holding the same parameters;
    `replicas` where others hold them: EDP for EP-split experts) where the ZeRO stage shards
    it (`Layout.shards_*`)."""
    n = layout.grad_replicas if replicas is None else replicas

    def shard(sharded: bool) -> int:
        return n if sharded else 1

    return {"params": e * psi / shard(layout.shards_parameters),
            "grads": 4 * psi / shard(layout.shards_gradients),
            "optimizer": (8 + (4 if e < 4 else 0)) * psi / shard(layout.shards_optimizer)}


def dp_traffic_elements(layout: Layout, psi: float, m: int) -> float:
    """DP ring elements one rank sends per step (ZERO_DP_TRAFFIC, reshard after forward).
    Zero 3: the table's bound, each unit gathered twice a micro-batch; the runtime gathers
    fewer (a unit that ends one pipeline operation and starts the next stays gathered,
    `megalite.parallel.zero3`), and the plan counts them exactly by walking the stage's
    schedule (`megalite.plan.zero3_gathers`, `megalite.plan.stage_terms.zero3_gathered`)."""
    n = layout.grad_replicas
    ring = (n - 1) / n * psi
    return {0: 2 * ring, 1: 2 * ring, 2: (m + 1) * ring, 3: 3 * m * ring}[layout.zero_stage]


def zero_table() -> str:
    """The table of docs/zero.md, rendered from `model_state_bytes` and `ZERO_DP_TRAFFIC`."""
    def formula(layout: Layout, e: int) -> str:
        parts = model_state_bytes(layout, 1, e)
        return " + ".join(f"{round(v * (layout.grad_replicas if v < 1 else 1))}Ψ"
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
                      head_copy: Optional[bool] = None, tied: bool = True,
                      blocks: Optional[range] = None) -> List[Tuple[str, int, bool]]:
    """(name, elements on one TP rank, tied) of a chunk's parameters in the stage's
    registration order (the family's spec lists: what the engine buckets; a test holds it to
    the model): `embedding.<j>` (the token embedding first), `h<block>.<j>`, `final.<j>` (the
    final norm), `lm_head`. `head_copy`: the LM head is a parameter of its own (default: last
    and not first); `tied`: the embedding's spec is tied (not zb-v's stage 0, where head and
    embedding are one parameter, nor an untied family's); `blocks`: which (each block's own
    parameters; default: the typical block's)."""
    v, h = d.vocab // d.layout.tp_size, d.cfg.model.n_embd
    tied_family = d.cfg.model.tie_word_embeddings
    sizes = [(f"embedding.{j}", size, tied and tied_family and j == 0)
             for j, size in enumerate(d.embeddings.units)] if first else []
    sizes += [(f"h{i}.{j}", size, False) for i in range(n)
              for j, size in enumerate(_block_units(d, blocks, i))]
    if last:
        sizes += [(f"final.{j}", size, False) for j, size in enumerate(d.final_norm.units)]
        copy = not first if head_copy is None else head_copy
        sizes += [("lm_head", v * h, tied_family)] if copy else []
    return sizes


def _block_units(d: Dims, blocks: Optional[range], i: int) -> List[int]:
    """The parameter sizes of a chunk's i-th block (`blocks` unknown: the typical block's)."""
    return (d.block if blocks is None else d.of(blocks[i]).params).units


def _bucket_numels(d: Dims, chunks: List[Tuple[ChunkEnds, int]]) -> List[int]:
    """Elements of each of the stage's buckets (zero 3: units) as the engine makes them."""
    return [numel for chunk in _backward_buckets(d, chunks) for numel, *_ in chunk]


def _backward_buckets(d: Dims, chunks: List[Tuple[ChunkEnds, int]]
                      ) -> List[List[Tuple[int, int, int, int]]]:
    """Per chunk, its buckets (zero 3: units) in the order a backward fills them, each as
    (elements, the chunk's blocks whose backward is done when its first gradient arrives,
    and when its last does, zero 3's gathered parameter elements then: the unit, the one
    prefetched, a stage's tied embedding kept for the head and, with v chunks, v - 1 other
    chunks' last units)."""
    lay, out = d.layout, []
    tied = any(ends.last and not ends.head_copy for ends, _ in chunks)
    for ends, n in chunks:
        first, last, head_copy = ends.first, ends.last, ends.head_copy
        if lay.shards_parameters:  # units: the embeddings, each block, the norm, the LM head
            out.append(_zero3_units(d, ends, n, tied))
            continue
        sizes = chunk_param_sizes(d, first, last, n, head_copy, ends.tied, ends.blocks)
        by_name = dict((name, s) for name, s, _ in sizes)
        groups = bucket_groups(sizes, d.cfg.parallel.bucket_mb * 2**20 / 4,
                               tied_alone=lay.pp_size > 1)
        out.append([(sum(by_name[name] for name in g), *_blocks_done(g, n), 0)
                    for g in groups])
    return out


def _zero3_units(d: Dims, ends: ChunkEnds, n: int, tied: bool
                 ) -> List[Tuple[int, int, int, int]]:
    """A chunk's ZeRO-3 units in backward order (`_backward_buckets`): the LM head, the final
    norm, each block, the embeddings (each its own unit: GPT-2's wte and wpe, Llama's
    embed_tokens), with what is gathered when each is reduced (it, the unit prefetched after
    it, a stage's tied embedding, v - 1 other chunks' last units)."""
    lay = d.layout
    vocab = d.vocab // lay.tp_size * d.cfg.model.n_embd
    layer, norm, first = d.layer_params, d.final_norm.numel, d.embeddings.units
    others = (lay.virtual_stages - 1) * layer + (vocab if tied else 0)
    kept = vocab if tied else 0  # the tied embedding, counted in `others`, is the unit itself
    sizes = [sum(_block_units(d, ends.blocks, i)) for i in range(n)]  # each block's unit
    before = [sizes[i - 1] if i else first[-1] if ends.first else 0 for i in range(n)]
    return ([(vocab, 0, 0, vocab + norm + others)] if ends.head_copy else []) \
        + ([(norm, 0, 0, norm + (sizes[-1] if n else 0) + others)] if ends.last else []) \
        + [(sizes[i], n - 1 - i, n - 1 - i, sizes[i] + before[i] + others)
           for i in reversed(range(n))] \
        + ([(first[j], n, n, first[j] + (first[j - 1] if j else 0) + others - kept)
            for j in reversed(range(len(first)))] if ends.first else [])


def _blocks_done(names: List[str], n: int) -> Tuple[int, int]:
    """Blocks of an n-block chunk whose backward is done when the first and when the last
    gradient of a bucket of `names` arrive (`chunk_param_sizes`' names: h{block}.{i},
    final.{i}, lm_head, embedding.{i}; the embeddings' come after every block's)."""
    blocks = [int(name[1:name.index(".")]) for name in names if name.startswith("h")]
    embedding = any(name.startswith("embedding.") for name in names)
    first = n - 1 - max(blocks) if blocks else n if embedding else 0
    last = n if embedding else n - 1 - min(blocks) if blocks else 0
    return first, last


def _padded(numel: int, dp: int) -> int:
    return max(dp, -(-numel // dp) * dp)


def grad_staging_bytes(d: Dims, chunks: List[Tuple[ChunkEnds, int]]) -> float:
    """Zero 2/3's full-size fp32 gradient staging as the engine declares it
    (`ZeroEngine.grad_staging_bytes`): the largest bucket (zero 3: unit) padded to N,
    REDUCTIONS_IN_FLIGHT + 1 of them. `chunks`: (`megalite.plan.chunks.ChunkEnds`, blocks)
    per chunk of the stage. What is alive when: `staging_alive`."""
    if not d.layout.shards_gradients:
        return 0.0
    return (REDUCTIONS_IN_FLIGHT + 1) * 4 * _padded(max(_bucket_numels(d, chunks)),
                                                    d.layout.grad_replicas)


def staging_alive(d: Dims, chunks: List[Tuple[ChunkEnds, int]]
                  ) -> Tuple[List[Tuple[float, int, int, float]], float]:
    """The DP reductions' staging: (the bytes alive as each bucket starts filling and as it
    launches, its chunk, the blocks of that chunk whose backward is done by then, zero 3's
    gathered parameter elements then), in backward order; and the bytes alive during the
    next forward. Per bucket of B elements (padded to N), R = REDUCTIONS_IN_FLIGHT:

      zero 2/3  filling: its full fp32 gradient, 4B; launched: a reduce-scatter holds its
                input until it is waited for (4B: the collective keeps it, NCCL's tensor
                stashing or gloo's work; not at N = 1, where the copy needs no collective)
                and its output (4B/N); at most R at once (the oldest is folded in before
                another launches); the backward's last R are folded in only before the next
                backward (`ZeroEngine.before_backward`): alive through the next forward
      zero 1    in the step's last backward each bucket's reduce-scatter output (4B/N, its
                input is the kept gradient), all alive until the step's gradient sync
      CPU       gloo's reduce-scatter works on a copy of its input (4B more while it runs;
                N > 1)
    """
    lay = d.layout
    if not lay.shards_optimizer:
        return [], 0.0
    dp, r = lay.grad_replicas, REDUCTIONS_IN_FLIGHT
    copy = 1 if lay.device_type != "cuda" and dp > 1 else 0
    timeline, pending = [], 0.0
    for c, buckets in enumerate(_backward_buckets(d, chunks)):
        full = [4 * _padded(numel, dp) for numel, *_ in buckets]
        if not lay.shards_gradients:  # zero 1
            for j, (b, (_, _, done, gathered)) in enumerate(zip(full, buckets)):
                timeline.append((sum(full[:j + 1]) / dp + copy * b, c, done, gathered))
            continue
        launched = [b * (1 if dp > 1 else 0) + b / dp for b in full]
        for j, (b, (_, first, last, gathered)) in enumerate(zip(full, buckets)):
            timeline.append((b + sum(launched[max(0, j - r):j]), c, first, gathered))
            timeline.append((b * (1 + copy) + b / dp + sum(launched[max(0, j - r + 1):j]),
                             c, last, gathered))
        pending = max(pending, sum(launched[-r:]))
    return timeline, pending
