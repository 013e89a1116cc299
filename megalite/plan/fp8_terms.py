"""What `fp8.recipe` adds to a block's plan (`megalite.parallel.fp8`): the short-lived copies
of one FP8 product (memory), the amax all-reduces over TP (collectives and wire bytes) and
the casts' memory traffic (time). The saved activations, parameters and checkpoints are the
same bytes as without FP8: nothing FP8 is stored.

Each FP8 linear (local input size K, output size N, n = s·b tokens of a micro-batch) runs
three products a [M, K'] @ b [N', K']ᵀ, with A, B, O the elements of a, b and the output:

  forward     x [n, K]  @ W [N, K]ᵀ
  dx          dy [n, N] @ (Wᵀ) [K, N]ᵀ        Wᵀ made contiguous: a copy of e·B
  dW          (dyᵀ) [N, n] @ (xᵀ) [K, n]ᵀ    both made contiguous: e·A and e·B

and one product holds at its peak, beyond its operands and output (`quantize`: an fp32
staging copy and the 1-byte result; `torch._scaled_mm`):

  casting a   e·A (a transposed copy) + 4A + A
  casting b   A + e·B (a transposed copy) + 4B + B
  product     CUDA: A + B (the FP8 operands; rowwise writes bf16 first: + 2·O where e = 4)
              CPU (the emulated kernel, measured by its allocations): A + 2B (a contiguous
              copy of b) + 4A (a in fp32) + max(4A, 8B, 4B + 4O + e·O) (b in fp32 twice, then
              the fp32 result and, where e < 4, its cast)

The eager figures: compiled on a GPU the amax, scale and cast fuse, and the staging copies
may not exist (unmeasured; the plan keeps the eager bound).

Amax all-reduces over TP (tp > 1), a block per micro-batch: where a scale spans a tensor
(tensorwise) or a contraction (rowwise) split over TP (`Fp8Linear.amax_group`):

  tensorwise  per FP8 linear of the family's block (`fp8_linears`): the forward's W
              (column-parallel), x and W (row-parallel), and the column-parallel dy in
              backward (its amax serves dx and dW; x's and W's are kept from the forward):
              GPT-2's two pairs 8 scalars, Llama's o_proj + gate_up_proj + down_proj 6
  rowwise     the row-parallel forward's x rows (n) and W rows (its outputs), the column-
              parallel dx's dy rows (n) and Wᵀ rows (its inputs): GPT-2 8 vectors, Llama 6
  recompute   a re-run forward stops once its saved tensors are rebuilt (torch's early stop),
              after the block's last linear (a custom function's tensors are saved when its
              forward returns): the forward's reductions only (GPT-2 6 scalars or 4 vectors,
              2(n + h); Llama 5 or 4)

Each is one fp32 all-reduce, 2(t−1)/t·4 bytes an element on the wire: latency-bound.

Cast traffic at HBM bandwidth, per operand element of every product: the eager chain reads
and writes abs (2e), reads the amax (e), the fp32 staging (e + 4), the scale and clamp
(4 · 4), the cast (4 + 1): 4e + 25 bytes (at most: a kept tensorwise amax skips the first
3e); compiled (train.compile) one read for the amax and
one read + 1-byte write for the cast: 2e + 1. A transposed operand's copy adds 2e."""
from __future__ import annotations

from typing import Dict, List, Tuple

from megalite.model.families import family

# (A, B, O, a copied, b copied): one product's operand and output elements
Product = Tuple[int, int, int, bool, bool]


def products(cfg, tp: int, tokens: int) -> Dict[str, List[Product]]:
    """The FP8 products of one block's linears on a TP rank: {"forward": [...], "backward":
    [...]} (dx and dW)."""
    out: Dict[str, List[Product]] = {"forward": [], "backward": []}
    for _, _, k, _, n in family(cfg.model).fp8_linears(cfg.model, tp):
        out["forward"].append((tokens * k, n * k, tokens * n, False, False))
        out["backward"] += [(tokens * n, k * n, tokens * k, False, True),
                            (n * tokens, k * tokens, n * k, True, True)]
    return out


def product_bytes(p: Product, e: int, device_type: str, rowwise: bool) -> float:
    """The most one product holds beyond its operands and output (the module docstring)."""
    a, b, o, a_copy, b_copy = p
    cast_a = (e if a_copy else 0) * a + 5 * a
    cast_b = a + (e if b_copy else 0) * b + 5 * b
    if device_type == "cuda":
        product = a + b + (2 * o if rowwise and e == 4 else 0)
    else:
        product = a + 2 * b + 4 * a + max(4 * a, 8 * b,
                                          4 * b + 4 * o + (e * o if e < 4 else 0))
    return float(max(cast_a, cast_b, product))


def fp8_working_bytes(cfg, layout, e: int) -> Dict[str, float]:
    """{"forward": the most a block's forward FP8 product holds at once, "backward": the
    same for its dx and dW products}; zeros without fp8.recipe."""
    if cfg.fp8.recipe == "none":
        return {"forward": 0.0, "backward": 0.0}
    tokens = cfg.train.seq_len // cfg.cp * cfg.train.micro_batch_size  # the rank's (s/cp)
    rowwise = cfg.fp8.recipe == "rowwise"
    return {phase: max(product_bytes(p, e, layout.device_type, rowwise) for p in ps)
            for phase, ps in products(cfg, layout.tp_size, tokens).items()}


def amax_reductions(cfg, tp: int, rerun: bool = False) -> Tuple[int, float]:
    """(all-reduces, fp32 elements reduced) of one block per micro-batch over TP; `rerun`:
    a recomputed block's forward re-run. (0, 0) at tp 1 or without fp8.recipe. Per FP8
    linear of the family's block (`fp8_linears`; row-parallel: its input split over TP):
    tensorwise, the forward reduces a column-parallel W's amax and a row-parallel x's and
    W's, the backward a column-parallel dy's (x's and W's are kept); rowwise, a
    row-parallel forward reduces x's rows (tokens) and W's rows (its outputs), a
    column-parallel dx dy's rows and Wᵀ's rows (its inputs)."""
    recipe = cfg.fp8.recipe
    if tp == 1 or recipe == "none":
        return 0, 0.0
    tokens = cfg.train.seq_len // cfg.cp * cfg.train.micro_batch_size  # the rank's (s/cp)
    linears = family(cfg.model).fp8_linears(cfg.model, tp)
    rows = [out for _, in_key, _, _, out in linears if "/ tp" in in_key]
    columns = [inp for _, in_key, inp, _, _ in linears if "/ tp" not in in_key]
    if recipe == "tensorwise":
        count = len(columns) + 2 * len(rows) + (0 if rerun else len(columns))
        return count, float(count)
    reduced = [tokens + out for out in rows] + ([] if rerun else [tokens + inp for inp in columns])
    return 2 * len(reduced), float(sum(reduced))


def cast_traffic_bytes(cfg, tp: int, e: int) -> float:
    """HBM bytes one block's FP8 casts move per micro-batch (forward and backward)."""
    if cfg.fp8.recipe == "none":
        return 0.0
    per_element = 2 * e + 1 if cfg.train.compile else 4 * e + 25
    tokens = cfg.train.seq_len // cfg.cp * cfg.train.micro_batch_size  # the rank's (s/cp)
    total = 0.0
    for ps in products(cfg, tp, tokens).values():
        for a, b, _, a_copy, b_copy in ps:
            total += (a + b) * per_element + 2 * e * (a * a_copy + b * b_copy)
    return total
