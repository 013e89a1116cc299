"""Making the parts of a run, in one phase: every part is built (and the run's position
restored into the stateful ones) before the `Trainer` is made; `megalite.train.trainer` runs
the steps. The order:

    data shards (bounded open files) -> model stage (this rank's chunks, initialised in every
        layout alike) -> step timers -> ZeRO engine -> pipeline schedule -> sampler and
        batches -> HellaSwag -> resilience services -> the run state (`train.run_state`: one
        list of the stateful parts) restored from `checkpoint.resume` -> run directory
        clean-up, stop request, profiler, saver -> metrics header and writer (rank 0)

The Config stays here: the parts get values or small objects made here (the engine's
`AdamWSettings`, the header's `ModelCounts`); what takes a section is the model (its
`ModelConfig`), the resilience services, the checkpoint's restore and saver (they write and
compare the whole config), the metrics header and the Trainer
(`scripts/dev/config_path.py` counts the path).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from megalite.checkpoint.async_save import CheckpointSaver
from megalite.checkpoint.resolve import checkpoint_root, set_aside_later_checkpoints
from megalite.checkpoint.save import written_numel
from megalite.checkpoint.state import Progress
from megalite.config.schema import Config
from megalite.data.documents import document_rule
from megalite.data.files import ShardFiles, open_file_budget, raise_open_file_limit
from megalite.data.loader import TokenShards, TrainBatches, check_vocab
from megalite.data.sampler import BlendedSampler, ResumableSampler
from megalite.eval.choice import ChoiceEval
from megalite.eval.hellaswag import ChoiceSet, load_choices
from megalite.model.activation_offload import ActivationOffload
from megalite.model.init import init_parameters, load_global_state
from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.step import RouterBiases
from megalite.model.stage import PipelineStage, build_stage
from megalite.parallel import comm
from megalite.parallel.context_attention import ContextParallel
from megalite.parallel.fp8 import use_fp8
from megalite.parallel.host_range import AdamWSettings
from megalite.parallel.pipeline import PipelineSchedule
from megalite.parallel.rng import RNGTracker
from megalite.parallel.zero import ZeroEngine
from megalite.plan.memory import Plan, make_plan
from megalite.resilience.hang_files import set_aside_old_dumps
from megalite.train.batch_size import BatchSizeSchedule
from megalite.train.header import ModelCounts, build_writer
from megalite.train.host_threads import set_cpu_threads, set_host_threads
from megalite.train.init_from import is_hub_id, load_init_state
from megalite.train.loss_scale import LossScaler
from megalite.train.metrics import Peak, peak_tflops
from megalite.train.profiling import StepProfiler
from megalite.train.resilience_services import build_resilience
from megalite.train.run_state import restore, run_state
from megalite.train.runtime import Runtime
from megalite.train.stop import StopRequest
from megalite.train.timers import StepTimers
from megalite.train.trainer import Trainer
from megalite.utils import log


def build_trainer(cfg: Config, runtime: Runtime, run_dir, planner: Optional[dict] = None,
                  plan: Optional[Plan] = None) -> Trainer:
    """Every part of a run of `cfg` (validated) on this rank, restored from
    `checkpoint.resume` where set. Collective: every rank calls it. `runtime`: made by
    `init_runtime(cfg)`. `planner`: layout=auto's choice and prediction
    (`AutoLayout.record()`), for the metrics header and records. `plan`: the launch's plan
    (`megalite.train.launch` makes it once), made here where not given."""
    run_dir = Path(run_dir)
    topo, layout, t = runtime.topology, runtime.layout, cfg.train
    log.configure(topo.rank, cfg.log.all_ranks)
    sources = cfg.data.sources()
    train_shards, val_shards = open_shards(sources, cfg.model.vocab_size)
    c = topo.coords
    # dropout streams differ over DP x CP (a CP rank's tokens are other tokens)
    rng = RNGTracker(cfg.seed, c.tp_rank, c.pp_rank, topo.grad_group.rank, runtime.device)
    model = build_model(cfg, runtime, layout.stage_blocks()[c.pp_rank], rng)
    family = model.family  # the model's size and cost, as its family counts them
    counts = ModelCounts(family.num_parameters(cfg.model),
                         family.flops_per_token(cfg.model, t.seq_len), family.flops_formula(),
                         family.active_parameters(cfg.model))
    timers = StepTimers(runtime.device, topo.counter.waits)  # times offload's waits too
    engine = build_engine(cfg, layout, topo, model, timers)
    set_host_threads(cfg.offload.optimizer, runtime.device)  # the host AdamW's cores
    set_cpu_threads(cfg.cpu_threads, cfg.offload.optimizer, runtime.device)
    shape = (t.micro_batch_size, cfg.model.n_embd)
    schedule = build_schedule(runtime, model, engine, t.seq_len, shape, cfg.parallel.schedule)
    sampler = build_sampler(runtime, train_shards, [w for _, w in sources], t.seq_len,
                            t.global_batch_size, cfg.seed)
    loss_scaler = LossScaler.from_config(cfg.loss_scale) \
        if runtime.compute_dtype == torch.float16 else None
    hellaswag = None if cfg.eval.hellaswag is None else build_hellaswag(
        load_choices(cfg), cfg.eval.hellaswag, runtime, model, engine, t.seq_len, shape)
    resilience = build_resilience(cfg, runtime, run_dir, model, engine, rng, loss_scaler)
    progress = Progress()
    state = run_state(progress, sampler, loss_scaler, resilience.rerun, rng, cfg.seed,
                      RouterBiases.of(model.chunks, topo.pp_group, runtime.device))
    ckpt_root = checkpoint_root(cfg.checkpoint.dir, run_dir)
    restore(cfg, ckpt_root, engine, topo, state)
    prepare_run_dir(runtime, run_dir, ckpt_root, progress.step, cfg.resilience.hang_dump)
    saver = CheckpointSaver(ckpt_root, cfg, topo, runtime.device,
                            background=cfg.checkpoint.async_save,
                            state_numel=written_numel(engine, topo))
    # MFU is reported by rank 0; the other ranks need not spend a CPU matmul measurement
    peak = peak_tflops(runtime.device, cfg.log.peak_tflops) if topo.rank == 0 \
        else Peak(None, "reported by rank 0")
    writer = build_writer(cfg, runtime, run_dir, model, engine, sources=sources,
                          data_meta=train_shards[0].meta, peak=peak, start_step=progress.step,
                          hellaswag=hellaswag, planner=planner, counts=counts,
                          plan=plan if plan is not None else make_plan(cfg, layout))
    return Trainer(
        cfg=cfg, rt=runtime, run_dir=run_dir, data_sources=sources, val_shards=val_shards,
        sampler=sampler,
        batches=TrainBatches(train_shards, sampler, t.micro_batch_size, t.seq_len,
                             runtime.device, reads=stage_reads(model),
                             documents=document_rule(t, train_shards[0].meta.get("eos_token_id"),
                                                     train_shards[0].dir),
                             cp=(topo.cp_size, c.cp_rank)),
        batch_size=BatchSizeSchedule(t.global_batch_size, t.rampup_batch_size),
        model=model, engine=engine, schedule=schedule, loss_scaler=loss_scaler,
        flops_per_token=counts.flops_per_token, progress=progress, state=state, saver=saver,
        stop_request=StopRequest(t.max_minutes, t.exit_signal, topo, runtime.device),
        profiler=StepProfiler(cfg.log.profile_steps, run_dir / "profile", topo.rank,
                              runtime.device),
        timers=timers, peak=peak, writer=writer, hellaswag=hellaswag, planner=planner,
        replicas=resilience.replicas, stragglers=resilience.stragglers,
        hang_watch=resilience.hang_watch, rerun=resilience.rerun,
        injector=resilience.injector)


def build_engine(cfg: Config, layout, topo, model: PipelineStage,
                 timers: Optional[StepTimers] = None) -> ZeroEngine:
    """The ZeRO engine of `model` as `cfg` sets it up (`parallel.bucket_mb`,
    `reshard_after_forward`, `overlap_param_gather`, `offload.optimizer`, the AdamW of
    `optim`): the one place a run's engine is made (the trainer, verify-rank). `timers`: the
    step timers the optimizer offload's waits count in (the `offload_wait` phase)."""
    o = cfg.optim
    adamw = AdamWSettings(o.lr, (o.betas[0], o.betas[1]), o.eps, o.weight_decay)
    return ZeroEngine(model, topo, layout, adamw, bucket_mb=cfg.parallel.bucket_mb,
                      reshard_after_forward=cfg.parallel.reshard_after_forward,
                      overlap_param_gather=cfg.parallel.overlap_param_gather,
                      offload_optimizer=cfg.offload.optimizer, offload_timers=timers)


def build_schedule(runtime: Runtime, model: PipelineStage, engine: ZeroEngine, seq_len: int,
                   shape: Tuple[int, int], schedule: str = "auto") -> PipelineSchedule:
    """A pipeline schedule (`parallel.schedule`; the forward-only one for evaluation) over
    this rank's chunks, for sequences of `seq_len` tokens; `shape`: (micro-batch size,
    hidden size)."""
    topo, layout = runtime.topology, runtime.layout
    return PipelineSchedule(
        model.chunks, topo, engine, (layout.activation_seq_len(seq_len), *shape),
        runtime.compute_dtype, runtime.device,
        scatter_group=None if layout.sequence_parallel else topo.tp_group, schedule=schedule)


def open_shards(sources: List[Tuple[Path, float]], vocab_size: int
                ) -> Tuple[List[TokenShards], List[TokenShards]]:
    """The train and validation shards of every data source, read through one bounded set of
    descriptors, their tokenizer checked against the model's vocabulary (`vocab_size`)."""
    files = shard_files()
    train_shards = [TokenShards(d, "train", files) for d, _ in sources]
    val_shards = [TokenShards(d, "val", files) for d, _ in sources]
    for shards in train_shards:
        check_vocab(shards.meta["vocab_size"], vocab_size)
    return train_shards, val_shards


def build_sampler(runtime: Runtime, train_shards: List[TokenShards], weights: List[float],
                  seq_len: int, global_batch_size: int, seed: int):
    """This DP rank's sampler: of one dataset, or of the blend of several by `weights`."""
    topo = runtime.topology
    dp_rank, dp = topo.coords.dp_rank, topo.dp_size
    sizes = [s.num_samples(seq_len) for s in train_shards]
    if len(sizes) == 1:
        return ResumableSampler(sizes[0], global_batch_size, dp_rank=dp_rank, dp_size=dp,
                                seed=seed)
    return BlendedSampler(sizes, weights, global_batch_size, dp_rank=dp_rank, dp_size=dp,
                          seed=seed)


def prepare_run_dir(runtime: Runtime, run_dir: Path, ckpt_root: Path, start_step: int,
                    hang_dump: bool) -> None:
    """Rank 0 moves the checkpoints after `start_step` aside (they belong to an abandoned
    continuation) and, with hang dumps (`hang_dump`), the old dumps; the other ranks wait
    for it."""
    topo = runtime.topology
    if topo.rank == 0:
        for moved in set_aside_later_checkpoints(ckpt_root, start_step):
            log.get_logger().info(f"this run starts at step {start_step}; moved "
                                  f"the later checkpoint to {moved}")
        if hang_dump:
            set_aside_old_dumps(run_dir)  # hang/ holds this launch's dumps only
    comm.barrier(topo.checkpoint_group)


def shard_files() -> ShardFiles:
    """The open-file limit raised to the hard limit where allowed, and the bounded set of shard
    descriptors this process reads every dataset through. The raise is logged (once a process:
    a later build, e.g. the self-test's next layout, finds it raised); an unchanged limit only
    at debug level."""
    before, after = raise_open_file_limit()
    budget = open_file_budget()
    change = f"raised from {before} to {after}" if after != before else f"{after}"
    log.get_logger().log(logging.INFO if after != before else logging.DEBUG,
                         f"open-file limit (soft) {change}; at most {budget} token shards "
                         "open at once")
    return ShardFiles(budget)


def stage_reads(model: PipelineStage) -> tuple:
    """(inputs, targets): what this rank's chunks consume of a batch — the inputs where it
    holds the first chunk (embeddings), the targets where it holds the last (the loss)."""
    return any(c.first for c in model.chunks), any(c.last for c in model.chunks)


def build_hellaswag(choices: ChoiceSet, source: str, runtime: Runtime, model: PipelineStage,
                    engine: ZeroEngine, seq_len: int, shape: Tuple[int, int]) -> ChoiceEval:
    """The evaluation of `eval.hellaswag`'s examples (`choices`, read from `source` and
    rendered with the data's tokenizer for train.seq_len = `seq_len`) by a forward-only
    pipeline schedule for their padded length (collective: its links say hello). `shape`:
    (micro-batch size, hidden size)."""
    topo, layout = runtime.topology, runtime.layout
    unit = 8 * (topo.tp_size if layout.sequence_parallel else 1)  # SP splits the sequence,
    unit *= 2 * topo.cp_size if topo.cp_size > 1 else 1  # CP into 2*cp chunks first
    length = choices.length(seq_len, unit)
    schedule = build_schedule(runtime, model, engine, length, shape)
    endings = sum(len(ex) for ex in choices.endings)
    log.get_logger().info(
        f"eval.hellaswag: {len(choices.labels)} examples ({endings} endings) from "
        f"{source}, read at length {length}; {choices.truncated} endings longer "
        f"than train.seq_len + 1 = {seq_len + 1} tokens left-truncated")
    return ChoiceEval(choices, schedule, topo, shape[0], length, runtime.device)


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
                            document_kernel=cfg.train.document_kernel,
                            recompute_layers=cfg.train.recompute_layers, offload=offload,
                            cp=ContextParallel(topo.cp_group, cfg.parallel.cp_comm),
                            expert_dispatch=TokenDispatcher(topo.ep_group,
                                                            cfg.parallel.ep_dispatch)
                            if topo.ep_size > 1 else None)
    use_fp8(model, cfg.fp8.recipe, topo.cp_group)
    if runtime.device.type == "meta":
        return model
    init_state = _init_state(cfg, runtime) if cfg.init_from else None
    for chunk in model.chunks:
        init_parameters(chunk, cfg.seed)
        if init_state is not None:
            load_global_state(chunk, init_state)
    if init_state is not None:  # rank 0 logs it
        values = sum(t.numel() for t in init_state.values())
        log.get_logger().info(f"init_from={cfg.init_from!r}: the model starts from its weights "
                              f"({len(init_state)} tensors, {values:,} values read)")
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


def broadcast_run_dir(run_dir: Path, topo) -> Path:
    """Rank 0's run directory, on every rank (Hydra's timestamp may differ between ranks)."""
    return Path(comm.broadcast_object(str(run_dir), topo.world_group))
