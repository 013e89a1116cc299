"""The one list of a training run's saved state (`megalite.checkpoint.state.RunState`), and
the run's position restored from `checkpoint.resume` through it.

    part         object                         in the checkpoint
    progress     Progress (step, skipped steps)  meta.json "step", "skipped_steps"
    sampler      ResumableSampler / Blended...   meta.json "sampler" (the data position; the
                                                 batch ramp is a function of it)
    loss_scaler  LossScaler (precision=fp16)     meta.json "loss_scaler" (null when off)
    rerun        RerunAttribution               meta.json "rerun" (null when off)
    moe_bias     RouterBiases (MoE with a bias)  meta.json "moe_bias" (a part only where a
                                                 router has a bias)
    rng          ProcessRNG                     rng_rank<r>.pt (restored under the writer's
                                                 layout only; else reseeded from the step)

The engine's master weights and moments are restored by `megalite.checkpoint.load` (under
any layout) before the list.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megalite.checkpoint.load import resume
from megalite.checkpoint.state import META, RANK, TOP, Part, ProcessRNG, Progress, RunState
from megalite.config.schema import Config
from megalite.model.moe.step import RouterBiases
from megalite.parallel.rng import RNGTracker
from megalite.parallel.topology import Topology
from megalite.parallel.zero import ZeroEngine
from megalite.resilience.rerun import RerunAttribution
from megalite.train.data_position import data_position_warnings
from megalite.train.loss_scale import LossScaler
from megalite.utils import log


def run_state(progress: Progress, sampler, loss_scaler: Optional[LossScaler],
              rerun: Optional[RerunAttribution], rng: RNGTracker, seed: int,
              moe_bias: Optional[RouterBiases] = None) -> RunState:
    """The run's stateful parts, each once (the module docstring). The RNG comes after the
    progress: its reseed reads the restored step."""
    moe = [Part("moe_bias", moe_bias, META)] if moe_bias is not None else []  # MoE only
    return RunState([
        Part("progress", progress, TOP),
        Part("sampler", sampler, META),
        Part("loss_scaler", loss_scaler, META),
        Part("rerun", rerun, META),
        *moe,
        Part("rng", ProcessRNG(rng, seed, progress), RANK),
    ])


def restore(cfg: Config, ckpt_root: Path, engine: ZeroEngine, topo: Topology,
            state: RunState) -> Optional[dict]:
    """The run's position from `checkpoint.resume` (none: step 0): the engine's tensors, then
    every part of `state`. Collective. Returns the checkpoint's meta (None without one)."""
    found = resume(cfg.checkpoint.resume, ckpt_root, engine, cfg, topo, state.rank_files)
    if found is None:
        return None
    path, loaded = found
    state.restore(loaded.meta, loaded.rank_files)
    logger = log.get_logger()
    for warning in data_position_warnings(loaded.meta, cfg):
        logger.warning(f"{warning}")
    logger.info(f"resumed from {path} at step {loaded.meta['step']}")
    return loaded.meta
