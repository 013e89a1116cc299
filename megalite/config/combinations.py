"""Every feature axis of a run and which combinations of their values megalite refuses: the
one home the combination matrix (`megalite.testing.matrix`, `megalite-bench matrix`) and the
user's support matrix (docs/support-matrix.md, `megalite.config.support_matrix`) read.

An axis is a feature with the values the matrix tries, each value a few configuration
settings (dotted keys). There is no second list of refusal rules: whether a combination is
refused is what `megalite.config.layout.validate` — the check every launch runs before any
process group exists — says about a run made of it (`refusal`), and a refused combination
carries the key and the message that validation raised. The matrix's own bound (at most
`MAX_RANKS` ranks a run, on a 2-core machine) is reported apart from megalite's refusals.
Which combinations are refused, and the rows the matrix runs: `megalite.config
.combination_search`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import Config

MAX_RANKS = 8  # the matrix's bound on tp * cp * pp * dp (tiny models on a few CPU cores)
# the test suite's array: of seeds 0-7 the strength-2 array that costs the fewest rank-runs
# (29 runs, 147 ranks in all, 10 of 8 ranks)
SUITE_SEED = 0
LLAMA = {"model.arch": "llama", "model.n_inner": 96, "model.rope_theta": 50000.0}
# MoE (docs/moe.md): a Mixtral of 4 experts, top 2, with the aux loss, the z-loss and the
# aux-loss-free bias on
MIXTRAL = {**LLAMA, "model.arch": "mixtral", "model.n_kv_head": 2, "model.n_inner": 32,
           "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.aux_loss_coeff": 0.01,
           "model.moe.z_loss_coeff": 0.001, "model.moe.bias_update_rate": 0.01}


@dataclass(frozen=True)
class Value:
    label: str
    settings: Dict[str, object]


@dataclass(frozen=True)
class Axis:
    name: str
    doc: str
    values: Tuple[Value, ...]

    def labels(self) -> List[str]:
        return [v.label for v in self.values]


def _axis(name: str, doc: str, *values: Tuple[str, Dict[str, object]]) -> Axis:
    return Axis(name, doc, tuple(Value(label, settings) for label, settings in values))


OFF, ON = "off", "on"
RESILIENCE_OFF = {"resilience.check_every": 0, "resilience.straggler_report_every": 0,
                  "resilience.hang_dump": False}
# the defaults on (hang watch, replica check, straggler report) with their periods inside
# a run of a few steps
RESILIENCE_ON = {"resilience.check_every": 1, "resilience.straggler_report_every": 1,
                 "resilience.hang_dump": True}

AXES: Tuple[Axis, ...] = (
    _axis("family", "model family; Llama's 2 KV heads split over tp=2, or its 1 KV head "
          "replicated over both TP ranks; a Mixtral MoE (4 experts, top 2, aux loss, z-loss "
          "and bias on)",
          ("gpt2", {"model.arch": "gpt2"}),
          ("llama kv split", {**LLAMA, "model.n_kv_head": 2}),
          ("llama kv replicated", {**LLAMA, "model.n_kv_head": 1}),
          ("mixtral moe", MIXTRAL)),
    _axis("tp", "tensor parallel size", ("1", {"tp": 1}), ("2", {"tp": 2})),
    _axis("cp", "context parallel size, and at 2 how attention crosses CP (parallel.cp_comm: "
          "keys and values all-gathered, or passed around the ring)",
          ("1", {"cp": 1, "parallel.cp_comm": "allgather"}),
          ("2 allgather", {"cp": 2, "parallel.cp_comm": "allgather"}),
          ("2 ring", {"cp": 2, "parallel.cp_comm": "ring"})),
    _axis("sp", "sequence parallelism", (OFF, {"sp": False}), (ON, {"sp": True})),
    _axis("pp", "pipeline stages", ("1", {"pp": 1}), ("2", {"pp": 2}), ("4", {"pp": 4})),
    _axis("schedule", "pipeline schedule (interleaved and zb-v: 2 model chunks a stage; "
          "interleaved with any m >= pp micro-batches, m < pp refused at "
          "train.global_batch_size; every schedule also with uneven stages, "
          "parallel.edge_stage_layers, refused by key where a slice would get no block)",
          ("1f1b", {"parallel.schedule": "1f1b", "parallel.virtual_stages": 1}),
          ("interleaved", {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2}),
          ("zb-h1", {"parallel.schedule": "zb-h1", "parallel.virtual_stages": 1}),
          ("zb-v", {"parallel.schedule": "zb-v", "parallel.virtual_stages": 2})),
    _axis("dp", "data parallel size (world = tp * cp * pp * dp)", ("1", {}), ("2", {})),
    _axis("rank order", "parallel.rank_order: Llama 3's [TP, CP, PP, DP] or Megatron's "
          "[TP, CP, DP, PP] (they differ where pp and dp are both 2)",
          ("tp-cp-pp-dp", {"parallel.rank_order": "tp-cp-pp-dp"}),
          ("tp-cp-dp-pp", {"parallel.rank_order": "tp-cp-dp-pp"})),
    _axis("ep", "expert parallelism (MoE only): the experts split over 2 of a stage's tp·cp·dp "
          "ranks, tokens exchanged by all-to-all or all-gather (parallel.ep_dispatch)",
          ("1", {"ep": 1}), ("2 alltoall", {"ep": 2, "parallel.ep_dispatch": "alltoall"}),
          ("2 allgather", {"ep": 2, "parallel.ep_dispatch": "allgather"})),
    _axis("zero", "ZeRO stage", *((str(z), {"zero": z}) for z in range(4))),
    _axis("optimizer offload", "offload.optimizer: the fraction of the optimizer state on the "
          "host", *((f"{f:g}", {"offload.optimizer": f}) for f in (0.0, 0.5, 1.0))),
    _axis("activation offload", "offload.activations (first blocks: the first block of each "
          "stage)", (OFF, {"offload.activations": False, "offload.activations_layers": None}),
          ("first blocks", {"offload.activations": True, "offload.activations_layers": 1})),
    _axis("recompute", "activation recomputation (some layers: the first block of each stage)",
          (OFF, {"train.recompute": False, "train.recompute_layers": None}),
          ("all", {"train.recompute": True, "train.recompute_layers": None}),
          ("some layers", {"train.recompute": True, "train.recompute_layers": 1})),
    _axis("fp8", "FP8 matmuls (emulated on CPU)", ("none", {"fp8.recipe": "none"}),
          ("tensorwise", {"fp8.recipe": "tensorwise", "fp8.emulate": True}),
          ("rowwise", {"fp8.recipe": "rowwise", "fp8.emulate": True})),
    _axis("precision", "parameters and activations (masters and moments fp32)",
          ("fp32", {"precision": "fp32"}), ("bf16", {"precision": "bf16"})),
    _axis("head", "LM head", ("tied", {"model.tie_word_embeddings": True}),
          ("untied", {"model.tie_word_embeddings": False})),
    _axis("batch", "global batch: constant, or ramped up from 4 sequences (train.rampup_"
          "batch_size=[4,4,8]: steps of 4, 4, then 8)", ("constant", {"train.rampup_batch_size": None}),
          ("ramp-up", {"train.rampup_batch_size": [4, 4, 8]})),
    _axis("resilience", "the resilience defaults (replica check, straggler report, hang watch)",
          (ON, RESILIENCE_ON), (OFF, RESILIENCE_OFF)),
    _axis("attention mask", "train.attention_mask (document: within each EOS-ended document, "
          "with train.reset_positions=true and train.eos_loss=false)",
          ("causal", {"train.attention_mask": "causal", "train.reset_positions": False,
                      "train.eos_loss": True}),
          ("document", {"train.attention_mask": "document", "train.reset_positions": True,
                        "train.eos_loss": False})),
)
# settings the matrix does not vary (numerics it cannot compare with the serial run, or
# features with their own tests), each tried beside every axis value alone: the support matrix
# lists the values that refuse one (`refused_settings`), e.g. cp 2 and attention dropout
OTHER_SETTINGS: Tuple[Tuple[str, Dict[str, object]], ...] = (
    ("attention dropout", {"model.attn_pdrop": 0.1}),
    ("flash attention", {"train.attention": "flash"}),
    ("torch.compile", {"train.compile": True}),
    ("HellaSwag", {"eval.hellaswag": "hellaswag_val.jsonl", "train.eval_every": 1}),
    ("rerun attribution", {"resilience.rerun": "on_nan"}),
    ("a named document kernel", {"train.attention_mask": "document",
                                 "train.document_kernel": "sdpa"}),
    # the family axis's Mixtral with transformers' pooled aux loss (one term of every layer's
    # routing; no z-loss, no bias)
    ("MoE with aux_loss=hf", {**MIXTRAL, "model.moe.aux_loss": "hf",
                              "model.moe.z_loss_coeff": 0.0, "model.moe.bias_update_rate": 0.0}),
)

# expert parallelism (docs/moe.md#expert-parallelism): the family axis's Mixtral at ep 2 over
# dp 2, and each of these tried beside it (the support matrix lists validation's verdicts); the
# first two are refused whatever the axes, by ep's own rules
EP_SETTINGS: Tuple[Tuple[str, Dict[str, object]], ...] = (
    ("a dense model", {"model.arch": "llama", "model.moe.num_experts": 0}),
    ("ep 4 over 2 ranks", {"ep": 4}),
    ("ep 2 and 3 experts", {"model.moe.num_experts": 3}),
    ("tp 2", {"tp": 2}), ("tp 2 with sp", {"tp": 2, "sp": True}), ("cp 2", {"cp": 2}),
    ("pp 2", {"pp": 2}),
    ("pp 2 zb-v", {"pp": 2, "parallel.schedule": "zb-v", "parallel.virtual_stages": 2}),
    ("zero 2", {"zero": 2}), ("zero 3", {"zero": 3}),
    ("layout auto", {"layout": "auto"}),
    ("overlapped parameter gather", {"zero": 1, "parallel.overlap_param_gather": True}),
    ("optimizer offload", {"offload.optimizer": 0.5}),
    ("HellaSwag", {"eval.hellaswag": "hellaswag_val.jsonl", "train.eval_every": 1}),
    ("init_from", {"init_from": "gpt2"}),
    ("FP8 tensorwise", {"fp8.recipe": "tensorwise", "fp8.emulate": True}),
    ("pp 2 zb-h1 zero 3", {"pp": 2, "parallel.schedule": "zb-h1", "zero": 3}),
    ("rerun attribution", {"resilience.rerun": "on_nan"}),
)


# the serial run a row is compared with: these axes at the row's values, every other at its
# first value (one rank, no offload, no recompute, the defaults on: numerics unchanged)
SERIAL_AXES = ("family", "fp8", "precision", "head", "batch", "attention mask")

# combinations of more than two values where a defect was found, in every array (the suite's
# strength 2 included): the first rows start from them
REGRESSIONS = (
    # optimizer offload squared the replicated KV heads' gradient pieces before their TP sum
    # (fp32 without FP8: held to the tight tolerance)
    {"family": "llama kv replicated", "tp": "2", "optimizer offload": "1", "precision": "fp32",
     "fp8": "none"},
)

# the values of the tightest tolerance (`megalite.testing.matrix.TOLERANCES`: 1e-5): every
# value of every other axis runs in some row with them, not only beside bf16 or FP8, whose
# bounds (1e-3 and more on the loss) would pass a defect of 1e-4
TIGHT = {"precision": "fp32", "fp8": "none"}

# the fixed settings of every matrix run: a tiny model (8 blocks: room for zb-v at pp=4),
# fp32-comparable (dropout 0), lr 1e-3 without warm-up (FP8 rounding differences grow
# chaotically over 3 steps at 1e-2: grad norms 7-47% apart at step 3 under tp=2),
# decaying over a fixed 4 steps (not max_steps: the run before the checkpoint is shorter)
MATRIX_BASE = ["device=cpu", "model.n_layer=8", "model.n_embd=64", "model.n_head=4",
               "model.n_positions=64", "model.vocab_size=1024", "model.resid_pdrop=0",
               "model.embd_pdrop=0", "model.attn_pdrop=0", "train.seq_len=32",
               "train.micro_batch_size=1", "train.global_batch_size=8", "train.eval_every=0",
               "optim.lr=1e-3", "optim.warmup_steps=0", "optim.decay_steps=4", "optim.eps=1e-6",
               "log.every=1", "log.wandb=false", "log.progress=false", "log.peak_tflops=1"]

Row = Tuple[int, ...]  # one value index per axis of AXES


@dataclass(frozen=True)
class Refusal:
    """Why a run of some values cannot be in the matrix: `kind` "megalite" (the key and the
    message of the ConfigError validation raised) or "matrix" (more than MAX_RANKS ranks)."""

    kind: str
    key: str
    message: str


def labels(row: Sequence[int]) -> Dict[str, str]:
    return {axis.name: axis.values[i].label for axis, i in zip(AXES, row)}


def row_of(values: Dict[str, str]) -> Row:
    """The row of the given labels, every other axis at its first value."""
    return tuple(axis.labels().index(values.get(axis.name, axis.values[0].label))
                 for axis in AXES)


def world_size(row: Sequence[int]) -> int:
    v = labels(row)
    return int(v["tp"]) * int(v["cp"].split()[0]) * int(v["pp"]) * int(v["dp"])


def settings(row: Sequence[int]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for axis, i in zip(AXES, row):
        out.update(axis.values[i].settings)
    return out


def row_config(base: Config, row: Sequence[int], extra: Optional[Dict[str, object]] = None
               ) -> Config:
    """`base` (MATRIX_BASE composed, with a data.dir) with the row's settings (and `extra`)."""
    cfg = copy.deepcopy(base)
    for key, value in {**settings(row), **(extra or {})}.items():
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, last, copy.deepcopy(value))
    return cfg


def serial_row(row: Sequence[int]) -> Row:
    """The row of the serial run `row` is compared with."""
    return row_of({k: v for k, v in labels(row).items() if k in SERIAL_AXES})


def refusal(base: Config, row: Sequence[int], extra: Optional[Dict[str, object]] = None
            ) -> Optional[Refusal]:
    """None when the row (with the `extra` settings) can run in the matrix; else why not."""
    world = world_size(row)
    if world > MAX_RANKS:
        return Refusal("matrix", "tp*cp*pp*dp", f"{world} ranks, over the matrix's "
                       f"{MAX_RANKS}")
    try:
        validate(row_config(base, row, extra), world)
    except ConfigError as e:
        return Refusal("megalite", e.key or str(e).split("=")[0], str(e))
    return None


def allowed_rows(base: Config) -> Callable[[Row], bool]:
    """The generator's constraint: validation's verdict on a whole row, remembered."""
    seen: Dict[Row, bool] = {}

    def allowed(row: Row) -> bool:
        if row not in seen:
            seen[row] = refusal(base, row) is None
        return seen[row]
    return allowed
