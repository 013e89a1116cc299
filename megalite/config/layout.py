"""The run's layout: how the model and the batch are spread over ranks, derived once.

A `Layout` is made from the validated configuration, the world size and the device kind before
any process group exists (`Layout.from_config`), and passed explicitly to everything that
needs sizes: the runtime, the topology, the trainer, the ZeRO engine, checkpoints, metrics and
the planner (`scripts/plan.py` makes Layouts for world sizes it does not run on). It holds no
rank: a process's coordinates are `Topology.coords`.

Also here, because they decide whether a layout can work at all: the device kind a run uses
(`device_type_for`), and `validate`, which runs every section's own checks and then the rules
that join sections or involve the world size, before launch (the grid's, the model split's and
the batch's in grid_rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megalite.config.document_kernel import check_document_kernel_on_device
from megalite.config.errors import fail
from megalite.config.expert_parallel import check_expert_parallel
from megalite.config.fp8 import check_fp8
from megalite.config.grid_rules import check_batch, check_grid, check_model_split
from megalite.config.inject import check_inject
from megalite.config.moe import check_layout as check_moe_layout
from megalite.config.schedule_rules import check_schedule
from megalite.config.schema import DEFAULT_RANK_ORDER, Config, check_sections
from megalite.config.stage_partition import ChunkPlacement, stage_chunks
from megalite.config.train_section import ATTENTION_CUDA_ONLY

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_type_for(setting: str, local_gpus: Optional[int]) -> str:
    """The device kind a run with `device=setting` uses on a node with `local_gpus` GPUs
    (None without CUDA): cuda when asked for (auto or cuda) and a GPU is there, else cpu."""
    return "cuda" if setting in ("auto", "cuda") and local_gpus else "cpu"


@dataclass(frozen=True)
class GpuInfo:
    """What a node's GPUs can do, as far as the configuration cares (`runtime.local_gpu`)."""

    name: str
    bf16: bool  # compute capability >= 8.0 (Ampere on); V100, T4 have none
    capability: Optional[Tuple[int, int]] = None  # (major, minor); FP8 needs >= (8, 9)


def resolved_precision(precision: str, device_type: str, bf16: bool = True) -> str:
    """What `precision` computes in on `device_type`: bf16, fp16 or fp32 (auto = bf16 on
    CUDA, fp16 with loss scaling on GPUs without bf16, fp32 elsewhere)."""
    if precision == "auto":
        return ("bf16" if bf16 else "fp16") if device_type == "cuda" else "fp32"
    return precision


@dataclass(frozen=True)
class Layout:
    """Sizes of the [TP, CP, PP, DP] grid, the ZeRO stage, sequence parallelism, the pipeline's
    virtual stages and the precision of one run (or of one planned run)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1  # context parallel: each sequence split over cp ranks (2·cp chunks)
    ep_size: int = 1  # expert parallel: the MoE experts split over ep of a stage's tp·cp·dp
    zero_stage: int = 0
    sequence_parallel: bool = False
    virtual_stages: int = 1
    micro_batch_size: int = 1
    precision: str = "fp32"  # resolved: fp32 | bf16 | fp16
    device_type: str = "cpu"  # cpu | cuda (or a planner's device profile)
    v_shape: bool = False  # parallel.schedule=zb-v: the chunks sit in a V (ChunkPlacement)
    n_layer: int = 0  # the model's blocks (0: a layout made without a model, e.g. a bench's)
    edge_stage_layers: Optional[int] = None  # parallel.edge_stage_layers
    rank_order: str = DEFAULT_RANK_ORDER  # parallel.rank_order (megalite.parallel.topology)

    @classmethod
    def of(cls, topo, **fields) -> "Layout":
        """The layout with `topo`'s sizes (a Topology built directly, as benchmarks and tests
        do) and the given other fields."""
        return cls(tp_size=topo.tp_size, pp_size=topo.pp_size, dp_size=topo.dp_size,
                   cp_size=getattr(topo, "cp_size", 1), ep_size=getattr(topo, "ep_size", 1),
                   rank_order=getattr(topo, "rank_order", DEFAULT_RANK_ORDER), **fields)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, device_type: str = "cpu",
                    bf16: bool = True) -> "Layout":
        """The layout of `cfg` (already validated) on `world_size` ranks of `device_type`
        (`bf16`: whether its GPUs compute in bf16)."""
        return cls(tp_size=cfg.tp, pp_size=cfg.pp, cp_size=cfg.cp, ep_size=cfg.ep,
                   dp_size=world_size // (cfg.tp * cfg.cp * cfg.pp),
                   zero_stage=cfg.zero, sequence_parallel=cfg.sp and cfg.tp > 1,
                   virtual_stages=cfg.parallel.virtual_stages,
                   micro_batch_size=cfg.train.micro_batch_size,
                   precision=resolved_precision(cfg.precision, device_type, bf16),
                   device_type=device_type, v_shape=cfg.parallel.schedule == "zb-v",
                   n_layer=cfg.model.n_layer, edge_stage_layers=cfg.parallel.edge_stage_layers,
                   rank_order=cfg.parallel.rank_order)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    @property
    def grad_replicas(self) -> int:
        """Ranks holding the same parameters and reducing their gradients together: DP x CP
        (a CP rank computes the same weights' gradients on other tokens; Megatron's
        `with_context_parallel`). ZeRO splits its ranges over these ranks."""
        return self.dp_size * self.cp_size

    @property
    def expert_grad_replicas(self) -> int:
        """EDP: ranks holding the same experts (tp·cp·dp / ep of the folded expert grid,
        `megalite.parallel.topology`); the experts' ZeRO ranges split over these."""
        return self.tp_size * self.cp_size * self.dp_size // self.ep_size

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO 1-3: each DP rank keeps the master weights and moments of its range only."""
        return self.zero_stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """ZeRO 2-3: each DP rank keeps the reduced gradient of its range only."""
        return self.zero_stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """ZeRO 3: each DP rank keeps its range of the parameters, gathered when used."""
        return self.zero_stage == 3

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the parameters and activations (masters and moments are always fp32)."""
        return PRECISION_DTYPES[self.precision]

    @property
    def placement(self) -> ChunkPlacement:
        return ChunkPlacement(self.pp_size, self.virtual_stages, self.v_shape)

    def stage_blocks(self) -> List[List[range]]:
        """Per pipeline stage, the block ranges of its chunks (in the schedule's chunk order):
        the one answer to "which blocks does this rank hold" (`stage_chunks`: the balanced
        or `edge_stage_layers` partition, placed plain, interleaved or in zb-v's V)."""
        if self.n_layer < 1:
            raise ValueError("this Layout was made without the model's n_layer "
                             "(Layout.from_config sets it): it cannot place blocks")
        return stage_chunks(self.n_layer, self.pp_size, self.virtual_stages,
                            self.edge_stage_layers, self.v_shape)

    def blocks_of(self, stage: int) -> List[range]:
        """The block ranges of pipeline stage `stage`'s chunks."""
        return self.stage_blocks()[stage]

    def micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches per DP rank in a step of `global_batch_size` sequences (with
        `train.rampup_batch_size` the global batch changes from step to step)."""
        return global_batch_size // (self.micro_batch_size * self.dp_size)

    def activation_seq_len(self, seq_len: int) -> int:
        """Positions of the residual stream one rank holds: seq_len / cp, and of those 1 / tp
        with SP."""
        local = seq_len // self.cp_size
        return local // self.tp_size if self.sequence_parallel else local

    def as_dict(self) -> dict:
        """The keys of the metrics header, checkpoint meta.json and the plan (stable names:
        meta.json's `layout` is read back at resume, users' tools read the header)."""
        return {"tp": self.tp_size, "cp": self.cp_size, "pp": self.pp_size, "dp": self.dp_size,
                "ep": self.ep_size,
                "zero": self.zero_stage, "sp": self.sequence_parallel,
                "virtual_stages": self.virtual_stages, "world_size": self.world_size,
                "rank_order": self.rank_order}


# --- validation before launch ------------------------------------------------------------


def validate(cfg: Config, world_size: int, local_gpus: Optional[int] = None,
             local_ranks: int = 1, gpu: Optional[GpuInfo] = None) -> List[str]:
    """Check the configuration for `world_size` ranks; raise ConfigError (naming the key, the
    value and what would work) on the first violation, return the warnings (legal but
    probably unintended settings) for the caller to print.

    Runs before any process group is created or any file is written. `local_gpus` is the
    number of GPUs of one node (None on CPU); `local_ranks` the processes started on this node
    (torchrun's --nproc_per_node), one GPU each on CUDA; `gpu` what they can do (None: a GPU
    with bf16)."""
    check_sections(cfg)
    return check_cross_section(cfg, world_size, local_gpus, local_ranks, gpu)


def check_cross_section(cfg: Config, world_size: int, local_gpus: Optional[int] = None,
                        local_ranks: int = 1, gpu: Optional[GpuInfo] = None) -> List[str]:
    """The rules that join sections or involve the world size and the node's GPUs."""
    warnings: List[str] = []
    check_grid(cfg, world_size)
    _check_device(cfg, local_gpus, local_ranks)
    warnings += _check_precision(cfg, device_type_for(cfg.device, local_gpus), gpu)
    check_schedule(cfg)
    check_model_split(cfg)
    if local_gpus is not None and cfg.tp > local_gpus:
        warnings.append(f"tp={cfg.tp} is larger than the {local_gpus} GPUs of one node: the TP "
                        "group's all-reduces in every layer will cross the inter-node network "
                        "and be slow; keep tp <= GPUs per node and use pp or dp across nodes")
    warnings += check_batch(cfg, world_size // (cfg.tp * cfg.cp * cfg.pp))
    check_expert_parallel(cfg, world_size)  # first: its refusals name ep (the matrix's rule)
    _check_other_pairs(cfg)
    _check_context_parallel(cfg)
    check_moe_layout(cfg)
    device_type = device_type_for(cfg.device, local_gpus)
    check_document_kernel_on_device(
        cfg.train.document_kernel, device_type,
        resolved_precision(cfg.precision, device_type, gpu is None or gpu.bf16),
        cfg.model.attn_pdrop, cfg.cp, cfg.model.n_embd // cfg.model.n_head,
        None if gpu is None else gpu.bf16)
    if cfg.resilience.inject is not None:  # the rank's tensor: the preflight (it needs a model)
        check_inject(cfg, world_size, resolved_precision(cfg.precision, device_type,
                                                         gpu is None or gpu.bf16))
    warnings += _check_offload(cfg, device_type) + cfg.offload.messages(device_type)
    warnings += check_fp8(cfg, device_type, gpu and gpu.name, gpu and gpu.capability)
    return warnings


def _check_device(cfg: Config, local_gpus: Optional[int], local_ranks: int) -> None:
    if cfg.device == "cuda" and not local_gpus:
        fail("device", cfg.device, "no CUDA GPU is visible on this machine; use device=auto "
              "(CPU when there is no GPU) or device=cpu")
    if cfg.device in ("auto", "cuda") and local_gpus and local_ranks > local_gpus:
        fail("torchrun --nproc_per_node", local_ranks, f"this node has {local_gpus} GPUs and "
              f"every rank needs its own; use --nproc_per_node<={local_gpus}, or device=cpu")
    attention = cfg.train.attention
    if attention in ATTENTION_CUDA_ONLY and device_type_for(cfg.device, local_gpus) == "cpu":
        fail("train.attention", attention, "this kernel runs on CUDA GPUs only; on CPU use "
              "auto, flash or math")


def _check_precision(cfg: Config, device_type: str, gpu: Optional[GpuInfo]) -> List[str]:
    """Precision x device x attention kernel: what cannot run is refused before launch."""
    bf16 = gpu is None or gpu.bf16
    name = gpu.name if gpu is not None else "this GPU"
    if device_type == "cuda" and cfg.precision == "bf16" and not bf16:
        fail("precision", "bf16", f"{name} does not compute in bf16 (compute capability below "
              "8.0: V100, T4, ...); use precision=fp16 (with loss scaling) or auto")
    precision = resolved_precision(cfg.precision, device_type, bf16)
    if cfg.loss_scale.static is not None and precision != "fp16":
        fail("loss_scale.static", cfg.loss_scale.static, f"only precision=fp16 scales the loss "
              f"(precision={cfg.precision!r}: bf16 and fp32 share fp32's exponent range and "
              "need no scaling); remove it or set precision=fp16")
    attention = cfg.train.attention
    if device_type == "cuda" and attention in ("flash", "cudnn"):
        if precision == "fp32":
            fail("train.attention", attention, "this kernel computes in fp16/bf16 only; with "
                  "precision=fp32 use auto, efficient or math")
        if not bf16:
            fail("train.attention", attention, f"this kernel needs an Ampere or newer GPU "
                  f"({name} is older); use auto, efficient or math")
    if device_type == "cuda" and cfg.precision == "auto" and not bf16:
        return [f"{name} does not compute in bf16: precision=auto trains in fp16 with dynamic "
                "loss scaling (loss_scale.*); set precision=fp32 for full precision"]
    return []


def _check_offload(cfg: Config, device_type: str) -> List[str]:
    """Offload that cannot save anything is allowed (the path runs), with a message."""
    if not cfg.offload.activations:
        return []
    if cfg.train.recompute and cfg.train.recompute_layers is None:
        return ["offload.activations=true with train.recompute=true recomputing every block "
                "offloads nothing (a recomputed block keeps only its input); offload the "
                "blocks after the recomputed ones with train.recompute_layers=N"]
    if device_type != "cuda":
        return ["offload.activations=true on CPU: the saved activations are copied from host "
                "memory to host memory, which saves nothing (the offload path runs, for "
                "testing); on CUDA they move to pinned host memory and free device memory"]
    return []


def _check_context_parallel(cfg: Config) -> None:
    """What cp > 1 does not run (yet): each refused by its key, before launch."""
    if cfg.cp == 1:
        return
    why = f"is not supported with cp={cfg.cp} (context parallelism)"
    if cfg.model.attn_pdrop > 0:
        fail("model.attn_pdrop", cfg.model.attn_pdrop, f"{why}: CP attention has no attention "
              "dropout; set model.attn_pdrop=0 or cp=1")
    if cfg.train.attention in ("flash", "cudnn"):
        fail("train.attention", cfg.train.attention, f"{why}: CP attention masks the chunks' "
              "keys, which this kernel cannot take; use auto, efficient or math")
    if cfg.train.compile:
        fail("train.compile", True, f"{why}: CP attention's collectives are not compiled; "
              "set train.compile=false")
    if cfg.fp8.recipe == "rowwise":
        fail("fp8.recipe", cfg.fp8.recipe, f"{why}: a weight gradient's row scales would span "
              "the CP ranks' tokens; use fp8.recipe=tensorwise (its amaxes are reduced over "
              "CP) or none")
    if cfg.resilience.rerun != "off":
        fail("resilience.rerun", cfg.resilience.rerun, f"{why}: the rerun attribution "
              "compares DP replicas only; use resilience.rerun=off or cp=1")


def overlap_gather_refuses(cfg: Config, zero: int) -> bool:
    """Whether parallel.overlap_param_gather refuses ZeRO stage `zero` (it needs 1 or 2;
    the layout search leaves the others out of its space)."""
    return cfg.parallel.overlap_param_gather and zero not in (1, 2)


def _check_other_pairs(cfg: Config) -> None:
    if cfg.eval.hellaswag is not None and cfg.train.eval_every == 0:
        fail("eval.hellaswag", cfg.eval.hellaswag,
              "runs with the validation loss every train.eval_every steps, and "
              "train.eval_every=0 never evaluates: set train.eval_every (e.g. 250), or "
              "eval.hellaswag=null")
    if overlap_gather_refuses(cfg, cfg.zero):
        fail("parallel.overlap_param_gather", True,
              f"needs zero=1 or zero=2 (zero={cfg.zero}: "
              + ("no parameter gather to overlap" if cfg.zero == 0 else
                 "ZeRO-3 gathers each block before use and prefetches the next already") + ")")
    steps = cfg.log.profile_steps
    if steps is not None and steps[0] > cfg.train.max_steps:
        fail("log.profile_steps", list(steps),
              f"two step numbers [first, last] with 1 <= first <= last and first <= "
              f"train.max_steps={cfg.train.max_steps}, e.g. [10, 12]; null = no profiling")
