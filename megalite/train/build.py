"""Making the parts of a run: data, model stage, engine, schedule, sampler, checkpointing,
metrics — and the run's position restored from a checkpoint. `megalite.train.trainer` runs the
steps; everything is built here, once, in this order:

    data shards (bounded open files) -> model stage (this rank's chunks, initialised in every layout alike)
        -> ZeRO engine -> pipeline schedule -> sampler and batches -> resume (engine state,
        sampler, loss scale, RNG, counters) -> stop request, profiler, timers, saver
        -> metrics header and writer (rank 0)
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from megalite.checkpoint.async_save import CheckpointSaver
from megalite.checkpoint.load import resume
from megalite.checkpoint.resolve import checkpoint_root, set_aside_later_checkpoints
from megalite.checkpoint.save import written_numel
from megalite.checkpoint.state import ProcessRNG
from megalite.config.inject import parse_inject
from megalite.config.schema import Config, data_sources
from megalite.data.files import ShardFiles, open_file_budget, raise_open_file_limit
from megalite.data.loader import TokenShards, TrainBatches, check_vocab
from megalite.data.sampler import BlendedSampler, ResumableSampler
from megalite.eval.choice import ChoiceEval
from megalite.eval.hellaswag import load_choices
from megalite.model.activation_offload import ActivationOffload
from megalite.model.gpt2 import flops_per_token, num_parameters
from megalite.model.init import init_parameters, load_global_state
from megalite.model.stage import PipelineStage, build_stage
from megalite.parallel import comm
from megalite.parallel.group import CollectiveWaits
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.rng import RNGTracker
from megalite.parallel.zero import ZeroEngine
from megalite.plan.memory import make_plan
from megalite.resilience.flight import FlightRecorder
from megalite.resilience.hang import HangWatch, set_aside_old_dumps
from megalite.resilience.hang_store import default_store
from megalite.resilience.inject import FaultInjector
from megalite.resilience.nccl_flight import set_nccl_flight_env
from megalite.resilience.replicas import ReplicaCheck
from megalite.resilience.rerun import RerunAttribution, use_deterministic_kernels
from megalite.resilience.stragglers import StragglerReport
from megalite.train.batch_size import BatchSizeSchedule
from megalite.train.data_position import data_position_warnings
from megalite.train.host_threads import set_host_threads
from megalite.train.init_from import is_hub_id, load_init_state
from megalite.train.loss_scale import LossScaler
from megalite.train.metrics import MetricsWriter, Peak, peak_tflops
from megalite.train.profiling import StepProfiler
from megalite.train.runtime import Runtime
from megalite.train.stop import StopRequest
from megalite.train.timers import StepTimers
from megalite.train.trainer import Trainer
from megalite.utils import log
from megalite.utils.clock import DeviceClock


def build_trainer(cfg: Config, runtime: Runtime, run_dir, planner: Optional[dict] = None
                  ) -> Trainer:
    """Every part of a run of `cfg` (validated) on this rank, restored from
    `checkpoint.resume` where set. Collective: every rank calls it. `planner`: layout=auto's
    choice and prediction (`AutoLayout.record()`), for the metrics header and records."""
    run_dir = Path(run_dir)
    topo, layout, t = runtime.topology, runtime.layout, cfg.train
    log.configure(topo.rank, cfg.log.all_ranks)
    sources = data_sources(cfg.data)
    files = shard_files()
    train_shards = [TokenShards(d, "train", files) for d, _ in sources]
    val_shards = [TokenShards(d, "val", files) for d, _ in sources]
    for shards in train_shards:
        check_vocab(shards.meta["vocab_size"], cfg.model.vocab_size)
    stages = layout.stage_blocks()
    c = topo.coords
    rng = RNGTracker(cfg.seed, c.tp_rank, c.pp_rank, c.dp_rank, runtime.device)
    model = build_model(cfg, runtime, stages[c.pp_rank], rng)
    engine = build_engine(cfg, layout, topo, model)
    set_host_threads(cfg.offload.optimizer, runtime.device)  # the host AdamW's cores
    schedule = PipelineSchedule(
        model.chunks, topo, engine,
        (layout.activation_seq_len(t.seq_len), t.micro_batch_size, cfg.model.n_embd),
        runtime.compute_dtype, runtime.device,
        scatter_group=None if layout.sequence_parallel else topo.tp_group,
        schedule=cfg.parallel.schedule)
    sizes = [s.num_samples(t.seq_len) for s in train_shards]
    sampler = ResumableSampler(sizes[0], t.global_batch_size, dp_rank=c.dp_rank,
                               dp_size=topo.dp_size, seed=cfg.seed) if len(sizes) == 1 \
        else BlendedSampler(sizes, [w for _, w in sources], t.global_batch_size,
                            dp_rank=c.dp_rank, dp_size=topo.dp_size, seed=cfg.seed)
    loss_scaler = LossScaler.from_config(cfg.loss_scale) \
        if runtime.compute_dtype == torch.float16 else None
    ckpt_root = checkpoint_root(cfg, run_dir)
    trainer = Trainer(
        cfg=cfg, rt=runtime, run_dir=run_dir, layout=layout, topo=topo, data_sources=sources,
        val_shards=val_shards, stages=stages, rng=rng, model=model, engine=engine,
        schedule=schedule, sampler=sampler,
        batches=TrainBatches(train_shards, sampler, t.micro_batch_size, t.seq_len,
                             runtime.device, reads=stage_reads(model)),
        batch_size=BatchSizeSchedule(t.global_batch_size, t.rampup_batch_size),
        loss_scaler=loss_scaler, ckpt_root=ckpt_root,
        flops_per_token=flops_per_token(cfg.model, t.seq_len), planner=planner)
    trainer.hellaswag = build_hellaswag(cfg, runtime, model, engine)
    resumed = restore(trainer)
    attach_services(trainer, train_shards[0].meta, resumed)
    return trainer


def build_engine(cfg: Config, layout, topo, model: PipelineStage) -> ZeroEngine:
    """The ZeRO engine of `model` as `cfg` sets it up (`parallel.bucket_mb`,
    `reshard_after_forward`, `overlap_param_gather`, `offload.optimizer`, the AdamW of
    `optim`): the one place a run's engine is made (the trainer, verify-rank)."""
    return ZeroEngine(model, topo, layout, cfg.optim, bucket_mb=cfg.parallel.bucket_mb,
                      reshard_after_forward=cfg.parallel.reshard_after_forward,
                      overlap_param_gather=cfg.parallel.overlap_param_gather,
                      offload_optimizer=cfg.offload.optimizer)


def shard_files() -> ShardFiles:
    """The open-file limit raised to the hard limit where allowed (logged), and the bounded set
    of shard descriptors this process reads every dataset through."""
    before, after = raise_open_file_limit()
    budget = open_file_budget()
    change = f"raised from {before} to {after}" if after != before else f"{after}"
    log.get_logger().info(f"open-file limit (soft) {change}; at most {budget} "
                          "token shards open at once")
    return ShardFiles(budget)


def stage_reads(model: PipelineStage) -> tuple:
    """(inputs, targets): what this rank's chunks consume of a batch — the inputs where it
    holds the first chunk (embeddings), the targets where it holds the last (the loss)."""
    return any(c.first for c in model.chunks), any(c.last for c in model.chunks)


def build_hellaswag(cfg: Config, runtime: Runtime, model: PipelineStage, engine: ZeroEngine
                    ) -> Optional[ChoiceEval]:
    """`eval.hellaswag`'s examples, rendered with the data's tokenizer, and a forward-only
    pipeline schedule for their padded length (collective: its links say hello)."""
    if cfg.eval.hellaswag is None:
        return None
    topo, layout, t = runtime.topology, runtime.layout, cfg.train
    choices = load_choices(cfg)
    unit = 8 * (topo.tp_size if layout.sequence_parallel else 1)  # SP splits the sequence
    length = choices.length(t.seq_len, unit)
    schedule = PipelineSchedule(
        model.chunks, topo, engine,
        (layout.activation_seq_len(length), t.micro_batch_size, cfg.model.n_embd),
        runtime.compute_dtype, runtime.device,
        scatter_group=None if layout.sequence_parallel else topo.tp_group)
    endings = sum(len(ex) for ex in choices.endings)
    log.get_logger().info(
        f"eval.hellaswag: {len(choices.labels)} examples ({endings} endings) from "
        f"{cfg.eval.hellaswag}, read at length {length}; {choices.truncated} endings longer "
        f"than train.seq_len + 1 = {t.seq_len + 1} tokens left-truncated")
    return ChoiceEval(choices, schedule, topo, t.micro_batch_size, length,
                      layout.virtual_stages, runtime.device)


def attach_services(trainer: Trainer, data_meta: dict, resumed: Optional[dict] = None
                    ) -> None:
    """What runs around the steps: later checkpoints set aside, the stop request, profiler,
    step timers and the resilience checks, checkpoint saver, the peak FLOP/s and (rank 0) the
    metrics writer."""
    cfg, topo, rt, t = trainer.cfg, trainer.topo, trainer.rt, trainer.cfg.train
    if topo.rank == 0:
        for moved in set_aside_later_checkpoints(trainer.ckpt_root, trainer.step):
            log.get_logger().info(f"this run starts at step {trainer.step}; moved "
                                  f"the later checkpoint to {moved}")
        if cfg.resilience.hang_dump:
            set_aside_old_dumps(trainer.run_dir)  # hang/ holds this launch's dumps only
    comm.barrier(topo.checkpoint_group)  # rank 0's clean-up of the checkpoint directory
    trainer.stop_request = StopRequest(t.max_minutes, t.exit_signal, topo, rt.device)
    trainer.profiler = StepProfiler(cfg.log.profile_steps, trainer.run_dir / "profile",
                                    topo.rank, rt.device)
    attach_resilience(trainer, resumed)
    trainer.saver = CheckpointSaver(trainer.ckpt_root, cfg, topo, rt.device,
                                    background=cfg.checkpoint.async_save,
                                    state_numel=written_numel(trainer.engine, topo))
    # MFU is reported by rank 0; the other ranks need not spend a CPU matmul measurement
    trainer.peak = peak_tflops(rt.device, cfg.log.peak_tflops) if topo.rank == 0 \
        else Peak(None, "reported by rank 0")
    state_bytes = gather_state_bytes(trainer.engine, topo, rt.device)
    if topo.rank == 0:
        trainer.writer = MetricsWriter(
            trainer.run_dir, run_header(trainer, data_meta, state_bytes), cfg.log.wandb,
            cfg.log.project, cfg.log.run_name, asdict(cfg), t.max_steps, trainer.step,
            cfg.log.progress)


def attach_resilience(trainer: Trainer, resumed: Optional[dict] = None) -> None:
    """The step timers, timing the waits in collectives when straggler reports are on, the
    replica check, the straggler report, the hang dumps' flight recorder and watch, the rerun
    attribution and the fault drill
    (`resilience.*`; None when off), the rerun's statistics from the `resumed` checkpoint's
    meta. Collective."""
    res, topo, rt = trainer.cfg.resilience, trainer.topo, trainer.rt
    waits = CollectiveWaits(DeviceClock(rt.device)) if res.straggler_report_every else None
    topo.counter.waits = waits
    trainer.timers = StepTimers(rt.device, waits)
    if trainer.engine.offload is not None:  # its waits on copies: the offload_wait phase
        trainer.engine.offload.timers = trainer.timers
    if res.check_every:
        trainer.replicas = ReplicaCheck(trainer.engine, topo, rt.device, res.check_every,
                                        trainer.layout.sequence_parallel, res.tp_rtol)
    if res.straggler_report_every:
        trainer.stragglers = StragglerReport(topo, rt.device, res.straggler_report_every,
                                             res.straggler_factor, res.straggler_min_s)
    if res.hang_dump:  # every group's collectives recorded; dumps while `fit` trains
        if rt.device.type == "cuda":  # PyTorch's NCCL flight recorder dumps to hang/nccl/
            set_nccl_flight_env(trainer.run_dir)
        train_s, checkpoint_s = res.hang_thresholds(trainer.cfg.parallel.timeout_s,
                                                    trainer.cfg.checkpoint.timeout_s)
        recorder = FlightRecorder(topo.rank, res.hang_history, hang_after_s=train_s,
                                  thresholds={topo.checkpoint_group.name: checkpoint_s})
        topo.counter.flight = topo.checkpoint_group.counter.flight = recorder
        trainer.hang_watch = HangWatch(recorder, trainer.run_dir, topo.rank, topo.world_size,
                                       res.hang_wait_s, res.hang_signal, default_store())
    if res.inject is not None:  # before the rerun: its gradient listener goes first
        trainer.injector = FaultInjector(parse_inject(res.inject), trainer.model,
                                         trainer.engine, topo.rank)
    if res.rerun != "off":
        if res.rerun_deterministic and use_deterministic_kernels(rt.device) and topo.rank == 0:
            log.get_logger().info("resilience.rerun: torch's deterministic algorithms "
                              "on (resilience.rerun_deterministic=true)")
        trainer.rerun = RerunAttribution(res, topo, rt.device, trainer.engine, trainer.rng,
                                         trainer.run_dir, trainer.loss_scaler)
        trainer.rerun.load_state_dict(None if resumed is None else resumed.get("rerun"))


def build_model(cfg: Config, runtime: Runtime, blocks: List[range], rng: RNGTracker
                ) -> PipelineStage:
    """This rank's model chunks, initialised to the same global weights in every layout (and
    loaded from `init_from` where set), sharing one `ActivationOffload` with
    offload.activations. On the meta device (`megalite.cli.verify_rank`) the
    tensors have shapes and no values: nothing is initialised or loaded."""
    topo, layout = runtime.topology, runtime.layout
    offload = ActivationOffload(runtime.device, cfg.offload.activations_layers) \
        if cfg.offload.activations and runtime.device.type != "meta" else None
    with torch.device(runtime.device):
        model = build_stage(cfg.model, blocks, topo.coords.pp_rank, topo.pp_size, layout.v_shape,
                            tp_group=topo.tp_group, sequence_parallel=layout.sequence_parallel,
                            rng=rng, recompute=cfg.train.recompute, compile=cfg.train.compile,
                            attention=cfg.train.attention,
                            recompute_layers=cfg.train.recompute_layers, offload=offload)
    if runtime.device.type == "meta":
        return model
    init_state = _init_state(cfg, runtime) if cfg.init_from else None
    for chunk in model.chunks:
        init_parameters(chunk, cfg.seed)
        if init_state is not None:
            load_global_state(chunk, init_state)
    return model


def _init_state(cfg: Config, runtime: Runtime):
    """The `init_from` weights. From the hub, the first rank of each node loads first (the
    download lands in the node's Hugging Face cache) and the node's other ranks then read that
    cache: one download per node, not one per rank at once."""
    if not is_hub_id(cfg.init_from):
        return load_init_state(cfg.init_from, cfg.model)
    first = runtime.local_rank == 0
    state = load_init_state(cfg.init_from, cfg.model) if first else None
    comm.barrier(runtime.topology.checkpoint_group)  # gloo, checkpoint.timeout_s: a download
    return state if first else load_init_state(cfg.init_from, cfg.model)


def restore(trainer: Trainer) -> Optional[dict]:
    """The run's position from `checkpoint.resume` (none: step 0), through the state_dict() of
    the objects that own it. Returns the checkpoint's meta (None without one)."""
    cfg, logger = trainer.cfg, log.get_logger()
    found = resume(cfg.checkpoint.resume, trainer.ckpt_root, trainer.engine, cfg, trainer.topo)
    if found is None:
        return None
    path, meta, rng_state = found
    trainer.step = meta["step"]
    trainer.skipped_steps = meta["skipped_steps"]
    if trainer.loss_scaler is not None:
        trainer.loss_scaler.load_state_dict(meta.get("loss_scaler"))
    trainer.sampler.load_state_dict(meta["sampler"])
    for warning in data_position_warnings(meta, cfg):
        logger.warning(warning)
    process_rng = ProcessRNG(trainer.rng)
    same_device = rng_state is not None and process_rng.accepts(rng_state)
    if rng_state is not None and not same_device:
        logger.warning(f"{path} was written on "
                       f"{rng_state.get('device_type', 'another')} devices, this run is on "
                       f"{trainer.rt.device.type}: everything is restored but the device's "
                       "dropout streams, which restart from the seed and the step")
    if rng_state is not None:
        process_rng.load_state_dict(rng_state, device_streams=same_device)
    if not same_device:  # another layout or device: fresh streams from the seed and the step
        trainer.rng.reseed(cfg.seed + 1_000_003 * trainer.step)
    logger.info(f"resumed from {path} at step {trainer.step}")
    return meta


def gather_state_bytes(engine: ZeroEngine, topo, device: torch.device) -> List[dict]:
    """Model-state bytes (parameters, gradients, optimizer) per pipeline stage, the most any
    rank of the stage holds, for the run header: a maximum over the stage's TP and DP ranks,
    then one summary per stage gathered to rank 0 (O(pp) objects there, not O(world))."""
    mine = engine.state_bytes()
    kinds = list(mine)
    values = [float(mine[k]) for k in kinds]
    for group in (topo.tp_group, topo.dp_group):
        values = comm.all_reduce_scalars(values, group, device, op=dist.ReduceOp.MAX)
    summary = {"pp": topo.coords.pp_rank, "ranks": topo.tp_size * topo.dp_size,
               **{k: int(v) for k, v in zip(kinds, values)}}
    gathered = comm.gather_objects_to_root(summary, topo.pp_group)
    return gathered if gathered is not None else []


def run_header(trainer: Trainer, data_meta: dict, state_bytes: List[dict]) -> dict:
    """The first line of metrics.jsonl: layout, model, batch, plan and model-state bytes."""
    cfg, m, t = trainer.cfg, trainer.cfg.model, trainer.cfg.train
    return {
        "layout": trainer.layout.as_dict(),
        "stages": [[[r.start, r.stop] for r in chunks] for chunks in trainer.stages],
        "micro_batches": trainer.layout.micro_batches(t.global_batch_size),
        "model": {"name": m.name, "n_layer": m.n_layer, "n_embd": m.n_embd,
                  "n_head": m.n_head, "n_positions": m.n_positions, "ffn_size": m.ffn_size},
        "vocab_size": m.vocab_size, "padded_vocab_size": trainer.model.padded_vocab,
        "tokenizer_vocab_size": data_meta["vocab_size"],
        "parameters": num_parameters(m),
        "flops_per_token": trainer.flops_per_token,
        "flops_formula": "6N + 12*L*h*s (N = parameters except position embedding)",
        "peak_tflops_per_device": trainer.peak.tflops, "peak_source": trainer.peak.source,
        "device": str(trainer.rt.device), "compute_dtype": str(trainer.rt.compute_dtype),
        "seq_len": t.seq_len, "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "model_state_bytes": state_bytes,
        "plan": make_plan(cfg, trainer.layout).as_dict(),
        "planner": trainer.planner,
        "data_dir": str(trainer.data_sources[0][0]),
        "data_sources": [[str(d), w] for d, w in trainer.data_sources],
        "run_dir": str(trainer.run_dir),
        "start_step": trainer.step,
        "hellaswag": None if trainer.hellaswag is None else {
            "source": cfg.eval.hellaswag, "examples": len(trainer.hellaswag.choices.labels),
            "length": trainer.hellaswag.length,
            "truncated_endings": trainer.hellaswag.choices.truncated},
    }


def broadcast_run_dir(run_dir: Path, topo) -> Path:
    """Rank 0's run directory, on every rank (Hydra's timestamp may differ between ranks)."""
    return Path(comm.broadcast_object(str(run_dir), topo.world_group))
