"""Typed configuration: the dataclasses behind `conf/*.yaml` and the cross-field rules.

Hydra composes `conf/config.yaml` (plus the `model=` and `data=` groups) on top of the
`Config` schema registered here, so a misspelt key or a wrong type fails at composition.
`validate()` then checks every rule that involves more than one field or the world size,
*before* any process group exists, and raises `ConfigError` naming the key, the bad value
and what would work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# Parallel dimensions that have landed. A value outside these sets is refused with a message
# saying which issue turns it on, instead of silently training something else.
SUPPORTED_TP = (1,)
SUPPORTED_PP = (1,)
SUPPORTED_ZERO = (0,)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names key, value and remedy."""


@dataclass
class ModelConfig:
    """GPT-2 shape, with `transformers.GPT2Config` field names."""

    name: str = "tiny"  # preset name, for the record (the shape below is what counts)
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 256
    vocab_size: int = 50257
    n_inner: Optional[int] = None  # MLP hidden size; None = 4 * n_embd (as in HF)
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    @property
    def ffn_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd


@dataclass
class DataConfig:
    """Where the token shards live and how `scripts/prepare_data.py` builds them."""

    name: str = "stdlib"
    dir: str = "data/stdlib"  # token shards + meta.json; relative paths are relative to the launch dir
    source: str = "stdlib"  # "stdlib" (Python's own .py sources) or a `datasets.load_dataset` path
    config_name: Optional[str] = None  # dataset config (e.g. "wikitext-103-raw-v1")
    split: str = "train"
    data_files: Optional[List[str]] = None  # local files for source=text/json/parquet
    text_field: str = "text"
    tokenizer: str = "train"  # HF tokenizer name/dir, or "train" = byte-level BPE trained on the corpus
    tokenizer_vocab_size: int = 8192  # vocabulary of a trained tokenizer
    val_fraction: float = 0.005  # share of documents held out for validation
    num_proc: int = 2  # tokenizer processes
    shard_tokens: int = 100_000_000  # tokens per shard file
    max_documents: Optional[int] = None  # cap on documents read (None = all)


@dataclass
class TrainConfig:
    max_steps: int = 300  # optimizer steps
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    global_batch_size: int = 32  # sequences per optimizer step over all DP ranks
    seq_len: int = 128
    eval_every: int = 100  # steps between validation passes (0 = never)
    eval_steps: int = 10  # global batches per validation pass (the same windows in any layout)


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the cosine decay
    warmup_steps: int = 30  # linear warmup from 0 to lr
    decay_steps: Optional[int] = None  # cosine decay length; None = train.max_steps
    weight_decay: float = 0.1  # applied to matrices only (not biases, LayerNorm, ...)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)


@dataclass
class LogConfig:
    every: int = 10  # steps between metric lines
    wandb: str = "auto"  # auto (online with credentials, else offline) | true | offline | false
    project: str = "megalite"
    run_name: Optional[str] = None
    peak_tflops: Optional[float] = None  # per-device peak FLOP/s override (TFLOP/s) for MFU
    progress: bool = True  # console progress bar


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None = <run dir>/checkpoints
    every: int = 0  # steps between checkpoints (0 = only at the end)
    resume: str = "none"  # none | auto (latest complete checkpoint in dir) | path to a checkpoint
    keep: int = 3  # most recent checkpoints kept


@dataclass
class Config:
    tp: int = 1  # tensor-parallel size (GPUs of one node)
    pp: int = 1  # pipeline-parallel size (stages)
    zero: int = 0  # ZeRO stage over the data-parallel dimension
    sp: bool = False  # sequence parallelism (with tp > 1)
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 autocast + fp32 master on CUDA, fp32 on CPU) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda
    init_from: Optional[str] = None  # HF GPT2LMHeadModel directory or hub id to load weights from
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register_configs() -> None:
    """Register the schema so Hydra type-checks `conf/config.yaml` against `Config`."""
    ConfigStore.instance().store(name="megalite_schema", node=Config)


def _fail(key: str, value, remedy: str) -> None:
    raise ConfigError(f"{key}={value!r}: {remedy}")


def dp_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.tp * cfg.pp)


def validate(cfg: Config, world_size: int) -> None:
    """Check every cross-field rule; raise ConfigError on the first violation.

    Runs before any process group is created or any file is written.
    """
    m, t, o = cfg.model, cfg.train, cfg.optim
    if cfg.tp < 1 or cfg.pp < 1 or world_size % (cfg.tp * cfg.pp) != 0:
        _fail("tp*pp", cfg.tp * cfg.pp, f"world size {world_size} must equal tp*pp*dp with "
              f"positive tp, pp; choose tp and pp whose product divides {world_size}")
    for key, value, ok in (("tp", cfg.tp, SUPPORTED_TP), ("pp", cfg.pp, SUPPORTED_PP)):
        if value not in ok:
            _fail(key, value, f"not implemented yet (supported: {list(ok)}); "
                  f"{'tensor' if key == 'tp' else 'pipeline'} parallelism lands with its own issue")
    if cfg.zero not in (0, 1, 2, 3):
        _fail("zero", cfg.zero, "ZeRO stage must be one of 0, 1, 2, 3")
    if cfg.zero not in SUPPORTED_ZERO:
        _fail("zero", cfg.zero, f"not implemented yet (supported: {list(SUPPORTED_ZERO)}); "
              "ZeRO stages 1-3 land with the ZeRO issue")
    if cfg.sp and cfg.tp == 1:
        _fail("sp", cfg.sp, "sequence parallelism needs tp > 1; set sp=false")
    dp = dp_size(cfg, world_size)
    if cfg.precision not in ("auto", "fp32", "bf16"):
        _fail("precision", cfg.precision, "use auto, fp32 or bf16")
    if cfg.device not in ("auto", "cpu", "cuda"):
        _fail("device", cfg.device, "use auto, cpu or cuda")
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
        if getattr(m, key) < 1:
            _fail(f"model.{key}", getattr(m, key), "must be a positive integer")
    if m.n_embd % m.n_head != 0:
        _fail("model.n_head", m.n_head, f"must divide model.n_embd={m.n_embd}")
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if not 0.0 <= getattr(m, key) < 1.0:
            _fail(f"model.{key}", getattr(m, key), "dropout probability must be in [0, 1)")
    if t.seq_len < 1 or t.seq_len > m.n_positions:
        _fail("train.seq_len", t.seq_len,
              f"must be in [1, model.n_positions={m.n_positions}]; lower seq_len or raise n_positions")
    if t.micro_batch_size < 1:
        _fail("train.micro_batch_size", t.micro_batch_size, "must be a positive integer")
    if t.global_batch_size < 1 or t.global_batch_size % (t.micro_batch_size * dp) != 0:
        good = t.micro_batch_size * dp
        _fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp} = {good} "
              f"(e.g. {good * max(1, round(t.global_batch_size / good))})")
    if t.max_steps < 1:
        _fail("train.max_steps", t.max_steps, "must be a positive integer")
    if t.eval_every < 0 or t.eval_steps < 1:
        _fail("train.eval_every/eval_steps", (t.eval_every, t.eval_steps),
              "eval_every must be >= 0 (0 = never) and eval_steps >= 1")
    if o.lr <= 0 or not 0 <= o.min_lr <= o.lr:
        _fail("optim.min_lr", o.min_lr, f"need 0 <= min_lr <= lr (lr={o.lr} must be > 0)")
    if o.warmup_steps < 0:
        _fail("optim.warmup_steps", o.warmup_steps, "must be >= 0")
    if o.decay_steps is not None and o.decay_steps < 1:
        _fail("optim.decay_steps", o.decay_steps, "must be >= 1 or null (= train.max_steps)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        _fail("optim.betas", list(o.betas), "two numbers in [0, 1), e.g. [0.9, 0.95]")
    if o.grad_clip < 0 or o.weight_decay < 0:
        _fail("optim.grad_clip/weight_decay", (o.grad_clip, o.weight_decay), "must be >= 0")
    if cfg.log.wandb not in ("auto", "true", "offline", "false"):
        _fail("log.wandb", cfg.log.wandb, "use auto, true, offline or false")
    if cfg.log.every < 1:
        _fail("log.every", cfg.log.every, "must be >= 1")
    if cfg.log.peak_tflops is not None and cfg.log.peak_tflops <= 0:
        _fail("log.peak_tflops", cfg.log.peak_tflops, "must be > 0 or null (= device table)")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        _fail("checkpoint.every/keep", (cfg.checkpoint.every, cfg.checkpoint.keep),
              "every must be >= 0 (0 = only at the end), keep >= 1")
    if cfg.checkpoint.resume not in ("none", "auto") and not Path(cfg.checkpoint.resume).exists():
        _fail("checkpoint.resume", cfg.checkpoint.resume,
              "use none, auto, or the path of an existing checkpoint directory")


def to_config(node) -> Config:
    """Turn a composed DictConfig (or a Config) into a `Config` object."""
    if isinstance(node, Config):
        return node
    obj = OmegaConf.to_object(node)
    assert isinstance(obj, Config), type(obj)
    obj.log.wandb = obj.log.wandb.lower()  # `log.wandb=true` arrives as the string "True"
    return obj


def load_config(overrides: Optional[List[str]] = None) -> Config:
    """Compose `conf/config.yaml` with command-line-style overrides, outside a Hydra app.

    For tests, benchmarks and tools (the training script uses `@hydra.main`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

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
