"""Document masking's attention work in the plan (`train.attention_mask=document`): how much of
the dense causal attention the masked kernel computes, and at what rate.

Under the mask a token attends to the earlier tokens of its own document only
(`megalite.model.document_attention`). Of a window's s(s+1)/2 causal (query, key) pairs the
mask leaves Σ n(n+1)/2 over its documents (`megalite.data.documents.visible_pairs`, the function
the loader logs with): the **pair fraction**. The kernels do not all skip the rest:

  flex    FlexAttention computes the 128×128 blocks of the causal triangle that hold a
          visible pair (`sample_blocks`); its work is the **block fraction** of the causal
          blocks
  varlen  FlashAttention-2's variable-length kernel computes each document's own triangle:
          its work is the **pair fraction** (its tiles' rounding at a document's edge is in
          its calibrated ratio)
  sdpa    SDPA with a dense boolean mask computes the dense causal work (fraction 1) and
          reads the mask besides
  cp      under cp > 1 (`parallel.cp_comm`: allgather or ring): the context-parallel kernel
          skips the chunk pairs, or the keys outside each piece's document, that the mask
          empties (`megalite.plan.document_cp`: its work on the slowest CP rank, from the
          same sample, for the run's cp and micro-batch): the ring at the causal kernel's
          rate (the same chunk-pair matmuls with or without the mask), the all-gather path
          on CUDA at the `flex` ratio where measured (FlexAttention with a block mask, its
          128-token blocks' rounding in that ratio), on CPU at the causal kernel's (maskless
          flash calls, a document piece at a time)

(which of flex, varlen and sdpa runs where: `megalite.config.document_kernel`; `kernel_work`).

The time model charges a block's attention (4·h·s FLOPs a token of the dense causal count, at
the matmul rate R) × work × ratio, ratio the masked kernel's time per unit of its work over the
causal kernel's, as `--calibrate` measured it (`megalite.plan.calibrate_mask`; 1 where the
profile has no measurement for the run's kernel, and for the ring and the CPU all-gather
path: the masked work at the causal kernel's rate; `masking`, applied by `megalite.plan.time_model` to
the attention term and to the block time that hides activation offload's copies;
`mask_seconds`: what it shows).

The fractions come from the corpus at plan time (`sample_corpus`: WINDOWS windows spread evenly
over data.dir's train split, read through `TokenShards`, never the whole corpus; under
data.blend each dataset's, weighted: `blend_of`), or, with `--document-tokens L`, from
documents of L tokens each (`fixed_length`); with neither, the plan assumes no saving
(fraction 1). The sample's document starts are kept (`DocumentSample`) so that the CP
kernels' work is priced for any cp without reading the corpus again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megalite.config.document_kernel import resolved_document_kernel
from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.data.documents import visible_pairs
from megalite.data.loader import TokenShards
from megalite.plan.devices import DeviceProfile
from megalite.plan.dims import recomputed_layers
from megalite.plan.document_cp import CpMaskedWork, DocumentSample, cp_masked_work

FLEX_BLOCK = 128  # FlexAttention's default block (queries × keys)
WINDOWS = 256  # windows sampled to estimate the fractions (stdlib: within 0.7 points of all)


@dataclass(frozen=True)
class MaskedWork:
    """The attention work the document mask leaves, as fractions of the dense causal work."""

    pairs: float  # visible (query, key) pairs / s(s+1)/2
    blocks: float  # 128×128 blocks holding a visible pair / the causal triangle's blocks
    source: str  # where the fractions come from
    seconds: float = 0.0  # what estimating them cost
    # the sampled windows' document starts (None: no sample), from which the CP kernels'
    # work is priced (`cp_work`)
    sample: Optional[DocumentSample] = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return (f"document mask: {self.pairs:.1%} of the causal (query, key) pairs visible, "
                f"{self.blocks:.1%} of its {FLEX_BLOCK}x{FLEX_BLOCK} blocks ({self.source})")


NO_SAVING = MaskedWork(1.0, 1.0, "no corpus and no --document-tokens: no saving assumed")


def sample_blocks(sample: DocumentSample, block: int = FLEX_BLOCK) -> int:
    """The blocks (query block i, key block j <= i) of a sample's windows that hold a visible
    pair. Documents are contiguous, so block (i, j < i) holds one iff the document of query
    block i's first token starts before key block j ends: query block i sees key blocks
    start // block .. i."""
    first = sample.document_start(np.arange(0, sample.seq_len, block))
    i = np.arange(first.shape[1])
    return int((i - first // block + 1).sum())


def causal_blocks(seq_len: int, block: int = FLEX_BLOCK) -> int:
    n = -(-seq_len // block)
    return n * (n + 1) // 2


def work_of(eos: np.ndarray, source: str, seconds: float = 0.0) -> MaskedWork:
    """The fractions of windows whose EOS tokens are `eos` (k, s)."""
    k, s = eos.shape
    sample = DocumentSample.of(eos)
    return MaskedWork(visible_pairs(eos) / (k * s * (s + 1) / 2),
                      sample_blocks(sample) / (k * causal_blocks(s)), source, seconds, sample)


def blend_of(parts: Sequence[Tuple[float, MaskedWork]]) -> MaskedWork:
    """The fractions of a data.blend of datasets, (weight, the dataset's fractions) each: the
    weighted average. Each fraction is a mean over windows of a per-window fraction with
    the same denominator in every dataset (a window's s(s+1)/2 causal pairs, its causal
    blocks), and the blend draws its windows from dataset i in the share w_i / Σw
    (`megalite.data.sampler.blend_choices`), so the blend's mean is Σ w_i·f_i / Σw. The CP
    kernels' work is not a per-window mean (a micro-batch skips only what all its windows
    allow): it is taken over the datasets' windows drawn as training draws them
    (`DocumentSample.blended`), so micro-batches mix the datasets."""
    total = sum(w for w, _ in parts)
    share = [(w / total, work) for w, work in parts]
    pooled = None if any(x.sample is None for _, x in share) else \
        DocumentSample.blended([x.sample for _, x in share], [w for w, _ in share])
    return MaskedWork(sum(w * x.pairs for w, x in share), sum(w * x.blocks for w, x in share),
                      "blend of " + ", ".join(f"{w:.3g} x ({x.source})" for w, x in share),
                      sum(x.seconds for _, x in share), pooled)


def sample_corpus(data_dir: Path, seq_len: int, windows: int = WINDOWS) -> MaskedWork:
    """The fractions over `windows` windows spread evenly over the train split of `data_dir`."""
    start = time.perf_counter()
    shards = TokenShards(Path(data_dir), "train")
    total = shards.num_samples(seq_len)
    picks = np.unique(np.linspace(0, total - 1, num=min(windows, total)).astype(np.int64))
    inputs = shards.samples(picks, seq_len)[:, :seq_len]
    eos = inputs == int(shards.meta["eos_token_id"])
    return work_of(eos, f"{len(picks)} of {total} windows of {data_dir}",
                   time.perf_counter() - start)


def fixed_length(document_tokens: int, seq_len: int, windows: int = WINDOWS) -> MaskedWork:
    """The fractions of documents of `document_tokens` tokens each, the windows starting at
    `windows` offsets spread over a document."""
    offsets = np.unique(np.linspace(0, document_tokens - 1, num=windows).astype(np.int64))
    t = np.arange(seq_len)
    eos = (offsets[:, None] + t[None, :]) % document_tokens == document_tokens - 1
    return work_of(eos, f"--document-tokens {document_tokens}")


def masked_work(cfg: Config, document_tokens: Optional[int]) -> Optional[MaskedWork]:
    """The run's fractions (None without the document mask): from --document-tokens where
    given, else from the corpus at data.dir (each dataset of data.blend: `blend_of`) where
    every one is prepared, else `NO_SAVING`."""
    if cfg.train.attention_mask != "document":
        return None
    if document_tokens is not None:
        return fixed_length(document_tokens, cfg.train.seq_len)
    sources = cfg.data.sources()
    if not all((Path(d) / "meta.json").is_file() for d, _ in sources):
        return NO_SAVING
    parts = [(w, sample_corpus(Path(d), cfg.train.seq_len)) for d, w in sources]
    return parts[0][1] if cfg.data.blend is None else blend_of(parts)


def masked_kernel(cfg: Config, device_type: str) -> str:
    """The kernel `megalite.model.document_attention` runs: flex, varlen or sdpa."""
    return resolved_document_kernel(cfg.train.document_kernel, device_type,
                                    cfg.model.attn_pdrop, cfg.train.attention)


def kernel_work(work: MaskedWork, kernel: str) -> float:
    """The part of the dense causal attention's work `kernel` computes (module docstring)."""
    return {"flex": work.blocks, "varlen": work.pairs}.get(kernel, 1.0)


def attention_factor(work: MaskedWork, kernel: str, ratio: Optional[float]) -> float:
    """The masked kernel's time over the dense causal attention's at the matmul rate: its work
    (`kernel_work`) × the calibrated `ratio` (1 where None)."""
    return kernel_work(work, kernel) * (1.0 if ratio is None else ratio)


def attention_forward_s(cfg: Config, lay: Layout, profile: DeviceProfile, blocks: int
                        ) -> float:
    """Seconds of `blocks` blocks' dense causal attention (4·h·s FLOPs a token) in one
    micro-batch's forward on a rank, at the matmul rate."""
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // lay.cp_size
    return blocks * 4 * cfg.model.n_embd * cfg.train.seq_len * tokens \
        / (lay.tp_size * profile.rate(lay.precision))


def cp_work(work: MaskedWork, cp: int, comm: str, batch: int) -> CpMaskedWork:
    """The CP kernel's work (`megalite.plan.document_cp`) over `work`'s sample; all of its
    causal plan where there is no sample (`NO_SAVING`)."""
    if work.sample is None:
        return CpMaskedWork(1.0, 1.0)
    return cp_masked_work(work.sample, cp, comm, batch)


def run_cp_work(cfg: Config, layout: Layout, work: MaskedWork) -> Optional[CpMaskedWork]:
    """`cp_work` at the run's cp, cp_comm and micro-batch (None at cp 1)."""
    if layout.cp_size == 1:
        return None
    return cp_work(work, layout.cp_size, cfg.parallel.cp_comm, cfg.train.micro_batch_size)


def describe_mask(cfg: Config, layout: Layout, work: MaskedWork,
                  cp: Optional[CpMaskedWork]) -> str:
    """The fractions and, under cp > 1, the CP kernel's share `cp` of its causal plan."""
    if cp is None:
        return work.describe()
    return (f"{work.describe()}; the cp={layout.cp_size} {cfg.parallel.cp_comm} kernel "
            f"computes {cp.mean:.1%} of its causal chunk pairs' work over the ranks, "
            f"{cp.slowest:.1%} on the slowest rank (micro-batches of "
            f"{cfg.train.micro_batch_size})")


def masking(cfg: Config, layout: Layout, profile: DeviceProfile,
            work: Optional[MaskedWork]) -> Optional[Dict[str, object]]:
    """The document mask's assumptions (None for causal attention): the fractions, the
    kernel and its `factor` over the dense causal attention's time (under cp > 1 the CP
    kernel's work on the slowest rank, at its rate: module docstring), and at
    cp = 1 each kernel the profile measured with its factor for these documents (`measured`:
    the faster one for this corpus)."""
    if cfg.train.attention_mask != "document":
        return None
    work = work or NO_SAVING
    cp = run_cp_work(cfg, layout, work)
    out = {"pairs": work.pairs, "blocks": work.blocks, "source": work.source,
           "describe": describe_mask(cfg, layout, work, cp)}
    if cp is not None:  # the all-gather path: FlexAttention on CUDA, maskless flash on CPU
        ratio = profile.mask_ratios.get("flex") \
            if cfg.parallel.cp_comm == "allgather" and profile.device_type == "cuda" else None
        return {**out, "kernel": f"cp {cfg.parallel.cp_comm}", "ratio": ratio,
                "factor": cp.slowest * (1.0 if ratio is None else ratio), "cp_mean": cp.mean,
                "cp_slowest": cp.slowest}
    kernel = masked_kernel(cfg, profile.device_type)
    return {**out, "kernel": kernel, "ratio": profile.mask_ratios.get(kernel),
            "factor": attention_factor(work, kernel, profile.mask_ratios.get(kernel)),
            "measured": {k: attention_factor(work, k, r) for k, r in profile.mask_ratios.items()}}


def mask_seconds(cfg: Config, layout: Layout, profile: DeviceProfile,
                 mask: Optional[Dict[str, object]], chunks: List[range]
                 ) -> Optional[Dict[str, object]]:
    """`mask` with the stage's attention seconds a step, masked and causal (forward,
    backward and recompute's re-run)."""
    if mask is None:
        return None
    passes = sum(3 * len(b) + recomputed_layers(cfg, len(b)) for b in chunks)
    causal = layout.micro_batches(cfg.train.global_batch_size) \
        * attention_forward_s(cfg, layout, profile, passes)
    return {**mask, "attention_s": causal * mask["factor"], "attention_causal_s": causal}
