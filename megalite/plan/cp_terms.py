"""Context parallelism's terms in the plan: what `megalite.parallel.context_attention` holds,
sends and waits for, per layer and micro-batch on one rank (the memory plan, the traffic and
the time model take them from here).

Sizes on one rank: L = s/cp the rank's tokens (two chunks of c = L/2), b the micro-batch,
hq and hk its query and KV heads (n_head/t; the KV heads split over TP, one where t exceeds
them), d the head dim, e the compute dtype's bytes, a = 4 the kernels' accumulation bytes
(fp32; the compute dtype's where wider); KV = e·b·2·hk·d·L the rank's K and V (`kv_bytes`).

Saved for backward beyond the family's formula at L tokens (`saved_bytes`):
  allgather   the gathered K and V, cp·KV (only the KV heads: grouped-query attention runs
              in the kernel, no K/V repeated; no mask: each query chunk's keys before it and
              its own causal block are two flash calls merged by their log-sum-exp, whose
              log-sum-exp and the output are the family's own terms); under document
              masking (`train.attention_mask=document`) the same, a document piece at a time
              on CPU, FlexAttention on CUDA: no mask is saved
  ring        the merged output in fp32 (a·b·hq·d·L, where e < a; the log-sum-exp is the
              family's own term)
Working bytes at the attention's peak (`working_bytes`; the forward moment and a block's
backward take them):
  allgather   forward: the local K|V concatenation and its sequence-first copy (2·KV) + the
              larger chunk's two partial outputs and their merge in the accumulation dtype
              (3·a·b·hq·d·c); backward: the gathered K/V gradient, summed in the
              accumulation dtype and cast back (on CPU; on CUDA FlexAttention's dK, dV and
              their slices put back into K|V), the larger: (1 + max(a/e, 2))·cp·KV (its
              resharded copy and the pieces' dK, dV come after or within that)
  ring        forward: two K/V blocks in flight (2·KV) + their expansion to hq heads under
              grouped-query attention (2·e·b·hq·d·L) + the partial outputs and a merge's
              temporary (2·a·b·hq·d·L) + one chunk pair's scores, shifted and exponentiated
              (3·a·b·hq·c²); backward: two blocks (2·KV) and two K/V gradient accumulators
              in flight (2·KV·a/e) + the expansion + dK, dV, dQ and the upcast dO
              (4·a·b·hq·d·L) + a pair's probabilities, dP and dS (3·a·b·hq·c²)
  + under document masking (`document_bytes`, forward and backward): the micro-batch's
    `DocumentSpans.first` (8·b·L, int64), and the allgather path's FlexAttention block mask
    on CUDA (`megalite.parallel.context_documents.block_mask_bytes`: int32 block counts and
    indices, built once per micro-batch) or the ring's one chunk pair's document mask and its
    complement (2·b·c² bools); no [b, c, S] mask exists
Wire bytes (`wire_bytes`, as `megalite.parallel.comm` counts them; a recomputed layer's
re-run forward repeats the forward's):
  allgather   forward an all-gather of K|V, backward a reduce-scatter of its gradient:
              (cp − 1)/cp · cp·KV each
  ring        forward cp − 1 sends of KV; backward cp − 1 sends of KV + cp sends of the
              K/V gradient accumulator (KV·a/e)
Time (`exposed_s`): CP runs on the CP group's link (`megalite.plan.links`: inside a node
while tp·cp ≤ GPUs per node). The all-gather and the reduce-scatter block the layer
(exposed, like TP's collectives). The ring posts each block's send before computing the
block in hand, so a send is exposed only beyond that step's compute (2 chunk pairs: 8·c²·d·hq·b
FLOPs forward at the matmul rate, twice that backward); the backward's accumulator sends
are waited for at once (exposed). Attention's FLOPs per rank are the causal work / cp: the
chunks' balance (ranks compute 2cp + 1 chunk pairs each) — the time model's compute term
(tokens / cp at the model's 4·h·s a token; under the document mask × the slowest rank's
unskipped share, `megalite.plan.document_cp`). The ring's steps hiding the sends are the
causal ones: under the document mask its skipped chunk pairs, which shorten a step, are not
taken off here.
"""
from __future__ import annotations

from typing import Dict

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.parallel.context_documents import block_mask_bytes
from megalite.plan.links import GroupLink, collective_time


def _heads(cfg: Config, tp: int):
    """(query heads, KV heads, head dim) on one TP rank."""
    m = cfg.model
    return m.n_head // tp, max(1, m.kv_heads // tp), m.head_size


def _sizes(cfg: Config, layout: Layout, e: int):
    hq, hk, d = _heads(cfg, layout.tp_size)
    local = cfg.train.seq_len // layout.cp_size
    return hq, hk, d, local, local // 2, cfg.train.micro_batch_size, max(e, 4)


def kv_bytes(cfg: Config, layout: Layout, e: int) -> float:
    """KV: the bytes of one rank's K and V for one micro-batch."""
    hq, hk, d, local, _, b, _ = _sizes(cfg, layout, e)
    return float(e * b * 2 * hk * d * local)


def saved_bytes(cfg: Config, layout: Layout, e: int) -> float:
    """Bytes a layer's CP attention saves beyond the family's formula (module docstring)."""
    cp = layout.cp_size
    if cp == 1:
        return 0.0
    if cfg.parallel.cp_comm == "allgather":
        return cp * kv_bytes(cfg, layout, e)
    hq, _, d, _, c, b, a = _sizes(cfg, layout, e)
    return float(a * b * hq * d * 2 * c) if e < a else 0.0


def working_bytes(cfg: Config, layout: Layout, e: int) -> Dict[str, float]:
    """{"forward", "backward"}: the attention's working bytes at its peak (module docstring)."""
    cp = layout.cp_size
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    hq, hk, d, local, c, b, a = _sizes(cfg, layout, e)
    kv, gqa = kv_bytes(cfg, layout, e), hq > hk
    documents = document_bytes(cfg, layout)
    if cfg.parallel.cp_comm == "allgather":
        return {"forward": 2 * kv + 3 * a * b * hq * d * c + documents,
                "backward": (1 + max(a / e, 2)) * cp * kv + documents}
    expanded = 2 * e * b * hq * d * local if gqa else 0.0
    scores = 3 * a * b * hq * c * c
    return {"forward": 2 * kv + expanded + 2 * a * b * hq * d * local + scores + documents,
            "backward": 2 * kv * (1 + a / e) + expanded + 4 * a * b * hq * d * local + scores
            + documents}


def document_bytes(cfg: Config, layout: Layout) -> float:
    """What the CP kernels hold for the document mask (module docstring): 0 without it."""
    cp = layout.cp_size
    if cp == 1 or cfg.train.attention_mask != "document":
        return 0.0
    _, _, _, local, c, b, _ = _sizes(cfg, layout, 2)
    if cfg.parallel.cp_comm == "allgather":
        held = block_mask_bytes(b, local, cfg.train.seq_len)
    else:
        held = 2 * b * c * c
    return float(8 * b * local + held)


def wire_bytes(cfg: Config, layout: Layout, e: int, layers: int, rerun: int) -> float:
    """CP wire bytes of `layers` layers (`rerun` of them recomputed) for one micro-batch."""
    cp = layout.cp_size
    if cp == 1:
        return 0.0
    kv = kv_bytes(cfg, layout, e)
    if cfg.parallel.cp_comm == "allgather":
        return (cp - 1) * kv * (2 * layers + rerun)
    accumulator = kv * max(e, 4) / e
    return (cp - 1) * kv * (2 * layers + rerun) + cp * accumulator * layers


def exposed_s(cfg: Config, layout: Layout, e: int, layers: int, rerun: int, rate: float,
              link: GroupLink, send_link: GroupLink) -> float:
    """CP's exposed seconds for `layers` layers (`rerun` recomputed) of one micro-batch:
    `rate` the matmul FLOP/s, `link` the CP group's (collectives), `send_link` its ring
    neighbours' (one rail across nodes). Module docstring."""
    cp = layout.cp_size
    if cp == 1:
        return 0.0
    kv = kv_bytes(cfg, layout, e)
    if cfg.parallel.cp_comm == "allgather":
        gather = collective_time((cp - 1) * kv, 1, link, cp, "all_gather")
        scatter = collective_time((cp - 1) * kv, 1, link, cp, "reduce_scatter")
        return (layers + rerun) * gather + layers * scatter
    hq, _, d, _, c, b, a = _sizes(cfg, layout, e)
    step = 8 * c * c * d * hq * b / rate  # a ring step's forward: two chunk pairs
    send = collective_time(kv, 1, send_link, 2, "send_recv")
    accumulator = collective_time(kv * a / e, 1, send_link, 2, "send_recv")
    forward = (cp - 1) * max(0.0, send - step)
    backward = (cp - 1) * max(0.0, send - 2 * step) + cp * accumulator
    return (layers + rerun) * forward + layers * backward
