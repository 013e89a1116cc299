"""Typed configuration: the dataclasses behind `conf/*.yaml` and the cross-field rules.

Hydra composes `conf/config.yaml` (plus the `model=` and `data=` groups) on top of the
`Config` schema registered here, so a misspelt key or a wrong type fails at composition.
Each section checks its own fields (`check()`, all of them through `check_sections`); the
rules that join sections or involve the world size live with the layout they decide
(`megalite.config.layout.validate` runs both, *before* any process group exists). Every check raises
`ConfigError` naming the key, the bad value and what would work.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megalite.config.errors import fail
from megalite.config.fp8 import Fp8Config
from megalite.config.known_keys import check_known_keys
from megalite.config.model import ModelConfig
from megalite.config.sections import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    LossScaleConfig,
    OffloadConfig,
    PlannerConfig,
    ResilienceConfig,
)
from megalite.config.train_section import TrainConfig

# the package's Hydra configs: in a checkout a link to `conf/`, in an installed package a copy
CONF_DIR = Path(__file__).parent.parent / "conf"
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")



@dataclass
class DataConfig:
    """Where the token shards live and how `scripts/prepare_data.py` builds them."""

    name: str = "stdlib"
    dir: str = "data/stdlib"  # token shards + meta.json; relative paths are relative to the launch dir
    source: str = "stdlib"  # "stdlib" (Python's own .py sources) or a `datasets.load_dataset` path
    config_name: Optional[str] = None  # dataset config (e.g. "wikitext-103-raw-v1")
    revision: Optional[str] = None  # hub branch, tag or commit of the dataset (None = main)
    split: str = "train"
    streaming: bool = False  # read a hub dataset as a stream (datasets' IterableDataset)
    #                          instead of downloading it whole first; the same shards
    data_files: Optional[List[str]] = None  # local files for source=text/json/parquet
    text_field: str = "text"
    tokenizer: str = "train"  # HF tokenizer name/dir, or "train" = byte-level BPE trained on the corpus
    tokenizer_vocab_size: int = 8192  # vocabulary of a trained tokenizer
    tokenizer_train_documents: Optional[int] = None  # tokenizer=train: train on the training
    #   documents among the first N documents (None = all; a stream needs a number)
    val_fraction: float = 0.005  # share of documents held out for validation
    num_proc: int = 2  # tokenizer processes
    shard_tokens: int = 100_000_000  # tokens per shard file
    max_documents: Optional[int] = None  # cap on documents read (None = all)
    blend: Optional[List[str]] = None  # train on several prepared dirs: [w1, dir1, w2, dir2, ...]
    #                                    (Megatron's weighted --data-path); None = `dir` alone

    def sources(self) -> List[Tuple[Path, float]]:
        """(directory, weight) of every dataset the run trains on: `data.blend` parsed, or
        `data.dir` alone with weight 1. Directories resolved against the launch directory."""
        if self.blend is None:
            return [(resolve_path(self.dir), 1.0)]
        items = list(self.blend)
        example = "e.g. data.blend=[0.7,data/owt,0.3,data/wiki]"
        if len(items) < 2 or len(items) % 2:
            fail("data.blend", items, f"alternate weights and prepared data directories, {example}")
        sources = []
        for weight, directory in zip(items[0::2], items[1::2]):
            try:
                w = float(weight)
            except ValueError:
                w = -1.0
            if not (w > 0 and math.isfinite(w)):
                fail("data.blend", items, f"weight {weight!r} (before {directory!r}) must be a "
                      f"positive number; {example}")
            sources.append((resolve_path(directory), w))
        if len({d for d, _ in sources}) != len(sources):
            fail("data.blend", items, "names a directory twice; give each dataset once")
        return sources


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the decay
    warmup_steps: int = 30  # linear warmup from 0 to lr
    schedule: str = "cosine"  # after warmup: cosine | linear | constant | wsd (megalite.train.optim)
    decay_steps: Optional[int] = None  # step at which the decay reaches min_lr; None = max_steps
    wsd_decay_fraction: float = 0.2  # wsd: share of the post-warmup steps spent decaying
    weight_decay: float = 0.1  # applied to matrices only (not biases, LayerNorm, ...)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)

    def check(self) -> None:
        if not self.lr > 0:
            fail("optim.lr", self.lr, "must be > 0 (e.g. 6e-4)")
        if not 0 <= self.min_lr <= self.lr:
            fail("optim.min_lr", self.min_lr, f"need 0 <= min_lr <= optim.lr={self.lr}")
        if not self.eps > 0:
            fail("optim.eps", self.eps, "AdamW's epsilon must be > 0 (e.g. 1e-8)")
        if self.schedule not in LR_SCHEDULES:
            fail("optim.schedule", self.schedule, f"use one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 < self.wsd_decay_fraction <= 1.0:
            fail("optim.wsd_decay_fraction", self.wsd_decay_fraction,
                  "must be in (0, 1], e.g. 0.2 (the last 20% of the steps after warmup decay)")
        if self.warmup_steps < 0:
            fail("optim.warmup_steps", self.warmup_steps, "must be >= 0")
        if self.decay_steps is not None and self.decay_steps < 1:
            fail("optim.decay_steps", self.decay_steps, "must be >= 1 or null (= train.max_steps)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            fail("optim.betas", list(self.betas), "two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.grad_clip < 0 or self.weight_decay < 0:
            fail("optim.grad_clip/weight_decay", (self.grad_clip, self.weight_decay),
                  "must be >= 0")

PIPELINE_SCHEDULES = ("auto", "1f1b", "interleaved", "zb-h1", "zb-v")  # parallel.schedule
CP_COMMS = ("allgather", "ring")  # parallel.cp_comm
EP_DISPATCHES = ("alltoall", "allgather")  # parallel.ep_dispatch
RANK_ORDERS = ("tp-cp-pp-dp", "tp-cp-dp-pp")  # parallel.rank_order (megalite.parallel.topology)
DEFAULT_RANK_ORDER = RANK_ORDERS[0]


@dataclass
class ParallelConfig:
    """Knobs of the parallel engines (the layout itself is the top-level tp, pp, zero, sp)."""

    bucket_mb: float = 25.0  # gradient bucket size (fp32 MiB) for the DP reductions (zero 0-2)
    reshard_after_forward: bool = True  # zero=3: free gathered blocks after forward (else keep
    #                                     them for the whole step: less traffic, more memory)
    overlap_param_gather: bool = False  # zero=1/2: all-gather the updated parameters during
    #                                    the next forward, each block waiting for its own bucket
    edge_stage_layers: Optional[int] = None  # blocks on the first and last pipeline stage (they
    #                                          also hold embedding / head); null = balanced
    virtual_stages: int = 1  # model chunks per pipeline stage: > 1 runs the interleaved 1F1B
    #                          schedule (Megatron's virtual pipeline): bubble (p-1)/(v·m+p-1)
    schedule: str = "auto"  # auto (interleaved if virtual_stages > 1, else 1f1b) | 1f1b |
    #                         interleaved | zb-h1 (zero bubble, B/W split) | zb-v (zero bubble
    #                         in a V, virtual_stages=2; docs/pipelines.md)
    cp_comm: str = "allgather"  # cp > 1: allgather (K/V gathered over CP before attention,
    #                             Llama 3's) | ring (K/V blocks passed around the CP ring)
    timeout_s: float = 600.0  # collective timeout: a stuck peer raises an error naming the
    #                           group (gloo); NCCL's watchdog ends the process, naming the group
    ep_dispatch: str = "alltoall"  # ep > 1: alltoall (each assignment's row sent to the rank
    #                                of its expert and back) | allgather (every rank's tokens
    #                                gathered over EP, the outputs reduce-scattered back;
    #                                docs/moe.md)
    rank_order: str = DEFAULT_RANK_ORDER  # how global ranks map to (tp, cp, pp, dp): tp-cp-pp-dp
    #   (Llama 3's: PP neighbours close, DP outermost) | tp-cp-dp-pp (Megatron's: PP outermost,
    #   a stage's ranks consecutive, so EP stays in a node; docs/parallelism.md)

    def check(self) -> None:
        v = self.virtual_stages
        if not isinstance(v, int) or v < 1:
            fail("parallel.virtual_stages", v, "must be a positive integer, and 1 unless pp >= 2 "
                  "(the interleaved schedule runs several model chunks per pipeline stage)")
        if self.schedule not in PIPELINE_SCHEDULES:
            fail("parallel.schedule", self.schedule, f"one of {', '.join(PIPELINE_SCHEDULES)} "
                  "(auto: interleaved with virtual_stages > 1, else 1f1b)")
        if not (self.bucket_mb > 0 and math.isfinite(self.bucket_mb)):
            fail("parallel.bucket_mb", self.bucket_mb, "must be a positive number of MiB "
                  "(e.g. 25; a value above the model's size gives one bucket per model chunk)")
        if self.cp_comm not in CP_COMMS:
            fail("parallel.cp_comm", self.cp_comm, f"one of {', '.join(CP_COMMS)}")
        if self.ep_dispatch not in EP_DISPATCHES:
            fail("parallel.ep_dispatch", self.ep_dispatch, f"one of {', '.join(EP_DISPATCHES)}")
        if self.rank_order not in RANK_ORDERS:
            fail("parallel.rank_order", self.rank_order, f"one of {', '.join(RANK_ORDERS)} "
                  "(tp-cp-dp-pp: Megatron's, a pipeline stage's ranks consecutive)")
        if self.timeout_s <= 0:
            fail("parallel.timeout_s", self.timeout_s, "must be > 0 seconds (e.g. 600)")

@dataclass
class Config:
    tp: int = 1  # tensor-parallel size (GPUs of one node)
    pp: int = 1  # pipeline-parallel size (stages)
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (docs/context-parallel.md)
    ep: int = 1  # expert-parallel size: each MoE layer's experts split over ep ranks, folded
    #              over the tp*cp*dp ranks of a pipeline stage (docs/parallelism.md)
    zero: int = 0  # ZeRO stage over the data-parallel dimension
    sp: bool = False  # sequence parallelism (with tp > 1)
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 params + fp32 master/moments on CUDA, fp32 on CPU) |
    #                          fp32 | bf16 | fp16 (fp16 params + fp32 master/moments, loss scaling)
    device: str = "auto"  # auto | cpu | cuda
    cpu_threads: Optional[int] = None  # a CPU rank's intra-op threads; null: OMP_NUM_THREADS
    #   where set, else the cores the load leaves per local rank (megalite/train/host_threads.py)
    layout: str = "manual"  # manual (tp, pp, zero, ... as given) | auto: the planner's fastest
    #                         predicted layout for the world size (docs/planner.md), the layout
    #                         keys given on the command line held fixed
    init_from: Optional[str] = None  # weights to start from: a transformers directory or hub id
    #                                  (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM,
    #                                  Qwen3(Moe)ForCausalLM: the model and its shape come from
    #                                  its config.json), or a megalite checkpoint (weights only,
    #                                  step 0)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)


def register_configs() -> None:
    """Register the schema so Hydra type-checks `conf/config.yaml` against `Config`."""
    ConfigStore.instance().store(name="megalite_schema", node=Config)


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def check_sections(cfg: Config) -> None:
    """Every section's own rules, and the top-level keys'."""
    if cfg.seed < 0:
        fail("seed", cfg.seed, "must be a non-negative integer (e.g. 1234)")
    if cfg.zero not in (0, 1, 2, 3):
        fail("zero", cfg.zero, "ZeRO stage must be one of 0, 1, 2, 3")
    if cfg.precision not in PRECISIONS:
        fail("precision", cfg.precision, f"use one of {', '.join(PRECISIONS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        fail("device", cfg.device, "use auto, cpu or cuda")
    if cfg.cpu_threads is not None and cfg.cpu_threads < 1:
        fail("cpu_threads", cfg.cpu_threads, "must be a positive integer, or null (chosen from "
             "the cores the load leaves per local rank)")
    if cfg.layout not in ("manual", "auto"):
        fail("layout", cfg.layout, "use manual (the sizes given) or auto (the planner's choice)")
    for section in (cfg.loss_scale, cfg.model, cfg.train, cfg.optim, cfg.parallel, cfg.log,
                    cfg.checkpoint, cfg.eval, cfg.offload, cfg.resilience, cfg.planner,
                    cfg.fp8):
        section.check()
    cfg.resilience.check_with_exit_signal(cfg.train.exit_signal)
    cfg.resilience.check_with_timeout(cfg.parallel.timeout_s)
    cfg.data.sources()  # raises on a malformed data.blend


def to_config(node) -> Config:
    """Turn a composed DictConfig (or a Config) into a `Config` object (ConfigError for a key
    the schema lacks)."""
    if isinstance(node, Config):
        return node
    obj = OmegaConf.to_object(node)
    assert isinstance(obj, Config), type(obj)
    check_known_keys(obj)  # `+train.max_step=30` adds a key nothing reads: refused by name
    obj.log.wandb = obj.log.wandb.lower()  # `log.wandb=true` arrives as the string "True"
    return obj


PRESET_GROUPS = ("model", "data")


def check_presets(overrides: Sequence[str]) -> None:
    """`model=<name>` and `data=<name>` name a yaml file of megalite/conf/<group>/ (checked
    before Hydra composes, whose own message lists its search path and exits 1)."""
    for override in overrides:
        group, sep, name = str(override).partition("=")
        group = group.lstrip("+~")
        if not sep or group not in PRESET_GROUPS:
            continue
        available = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        if name not in available:
            fail(group, name, f"no such preset; use one of {', '.join(available)} (the files "
                 f"in {CONF_DIR / group})")


def load_config(overrides: Optional[List[str]] = None) -> Config:
    """Compose `conf/config.yaml` with command-line-style overrides, outside a Hydra app.

    For tests, benchmarks and tools (the training script uses `@hydra.main`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_presets(overrides or [])
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose(config_name="config", overrides=list(overrides or []))
    return to_config(node)


def resolve_path(path: str, base: Optional[str] = None) -> Path:
    """A relative path is relative to the directory the run was launched from."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    return Path(base or os.getcwd()) / p
