"""The rules of the grid before launch: the world size as tp*cp*pp*dp, what TP, CP and PP
split of the model (heads, MLP, positions, blocks into stages and virtual stages), and the batch
as whole micro-batches on every DP rank in the groups the pipeline schedule needs (and the batch
size ramp-up's steps likewise). Each raises ConfigError naming the key; `check_batch` returns
the warnings of a legal but probably unintended batch. Called by `layout.check_cross_section`.
"""
from __future__ import annotations

from typing import List

from megalite.config.errors import fail
from megalite.config.families import registered_family
from megalite.config.presets import longer_context
from megalite.config.schedule_rules import expected_bubble, groups_micro_batches
from megalite.config.schema import Config
from megalite.config.stage_partition import edge_split_problem


def check_grid(cfg: Config, world_size: int) -> None:
    if world_size < 1:
        fail("world size", world_size, "needs at least one rank (torchrun --nproc_per_node, "
              "megalite-plan --world-size)")
    if not isinstance(cfg.cp, int) or cfg.cp < 1:
        fail("cp", cfg.cp, "must be a positive integer (1: no context parallelism)")
    if cfg.tp < 1 or cfg.pp < 1 or world_size % (cfg.tp * cfg.cp * cfg.pp) != 0:
        fail("tp*cp*pp", cfg.tp * cfg.cp * cfg.pp, f"world size {world_size} must equal "
              f"tp*cp*pp*dp with positive tp, cp, pp; choose tp, cp and pp whose product "
              f"divides {world_size}")
    if cfg.sp and cfg.tp == 1:
        fail("sp", cfg.sp, "sequence parallelism needs tp > 1; set sp=false")


def check_model_split(cfg: Config) -> None:
    """TP splits heads, the embedding and the MLP; PP (and its virtual stages) the blocks."""
    m, t = cfg.model, cfg.train
    if m.n_head % cfg.tp:
        fail("tp", cfg.tp, f"must divide model.n_head={m.n_head} (attention is split by heads)")
    if m.n_embd % cfg.tp:
        fail("tp", cfg.tp, f"must divide model.n_embd={m.n_embd}")
    family = registered_family(m.arch)
    family.check_tp(m, cfg.tp)
    if cfg.tp > 1 and not cfg.sp and getattr(family, "tp_partial_weights", False):
        fail("sp", cfg.sp, f"model.arch={m.arch} with tp={cfg.tp} needs sp=true: weights every "
             "TP rank uses on its own heads (its q/k norms) have their gradients summed over "
             "TP with sequence parallelism's norms")
    if m.ffn_size % cfg.tp:
        fail("tp", cfg.tp, f"must divide the MLP size {m.ffn_size} (model.n_inner)")
    if t.seq_len > m.n_positions:
        fail("train.seq_len", t.seq_len,
              f"must be in [1, model.n_positions={m.n_positions}]; lower seq_len or raise "
              f"model.n_positions{longer_context(m, t.seq_len)}")
    cut = 2 * cfg.cp  # the load-balanced chunks of a sequence (parallel/context_shard.py)
    if cfg.cp > 1 and t.seq_len % cut:
        fail("train.seq_len", t.seq_len, f"with cp={cfg.cp} must be divisible by 2*cp = {cut} "
              f"(each sequence is cut into 2*cp chunks); e.g. {t.seq_len - t.seq_len % cut}")
    local = t.seq_len // cfg.cp
    if cfg.sp and local % cfg.tp:
        good = t.seq_len - t.seq_len % (cfg.tp * cut if cfg.cp > 1 else cfg.tp)
        fail("train.seq_len", t.seq_len, f"with sp=true, seq_len/cp = {local} must be "
              f"divisible by tp={cfg.tp} (each TP rank holds seq_len/(cp*tp) positions); "
              f"e.g. {good}")
    if cfg.pp > m.n_layer:
        fail("pp", cfg.pp, f"more pipeline stages than blocks (model.n_layer={m.n_layer}) would "
              f"leave a stage with no block; use pp <= {m.n_layer}")
    v = cfg.parallel.virtual_stages
    if v > 1 and cfg.pp < 2:
        fail("parallel.virtual_stages", v, "must be a positive integer, and 1 unless pp >= 2 "
              "(the interleaved schedule runs several model chunks per pipeline stage)")
    if cfg.pp * v > m.n_layer:
        fail("parallel.virtual_stages", v, f"pp*virtual_stages = {cfg.pp * v} model chunks "
              f"need at least as many blocks (model.n_layer={m.n_layer}); use virtual_stages <= "
              f"{m.n_layer // cfg.pp}")
    edge = cfg.parallel.edge_stage_layers
    if edge is not None:
        problem = edge_split_problem(m.n_layer, cfg.pp * v, edge)
        if problem is not None:
            fail("parallel.edge_stage_layers", edge, problem)


def check_batch(cfg: Config, dp: int) -> List[str]:
    """Whole micro-batches on every DP rank, in the groups the schedule needs."""
    t, v, warnings = cfg.train, cfg.parallel.virtual_stages, []
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        good = t.micro_batch_size * dp
        fail("train.global_batch_size", t.global_batch_size,
              f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp} = {good} "
              f"(e.g. {good * max(1, round(t.global_batch_size / good))}); the number of "
              "micro-batches per step m = global_batch_size / (micro_batch_size*dp) must be >= 1")
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    _check_rampup_units(cfg, dp)
    if groups_micro_batches(cfg) and num_micro < cfg.pp:
        good = cfg.pp * t.micro_batch_size * dp
        fail("train.global_batch_size", t.global_batch_size,
              f"with parallel.virtual_stages={v} the micro-batches per step m = "
              f"global_batch_size/(micro_batch_size*dp) = {num_micro} must be >= pp={cfg.pp} "
              f"(the interleaved schedule runs them in groups of at least pp); use "
              f"global_batch_size >= {good} (any multiple of {t.micro_batch_size * dp})")
    if cfg.pp > 1 and num_micro < cfg.pp:
        bubble = expected_bubble(cfg.pp, num_micro, v, cfg.parallel.schedule)
        warnings.append(f"m = global_batch_size/(micro_batch_size*dp) = {num_micro} micro-batches "
                        f"< pp={cfg.pp}: the pipeline will idle about {bubble:.0%} of each step "
                        f"({cfg.parallel.schedule} schedule); raise train.global_batch_size or "
                        "lower train.micro_batch_size")
    if cfg.zero > 0 and dp * cfg.cp == 1:
        # ZeRO shards over the DP x CP group (topology's grad_group), so cp > 1 at dp = 1 shards.
        warnings.append(f"zero={cfg.zero} with data-parallel x context-parallel size 1 shards "
                        "nothing (it changes no memory and only adds copies); use zero=0 or "
                        "more ranks")
    return warnings


def _check_rampup_units(cfg: Config, dp: int) -> None:
    t = cfg.train
    if t.rampup_batch_size is None:
        return
    ramp = list(t.rampup_batch_size)
    unit = t.micro_batch_size * dp
    start, increment, _ = ramp
    if start % unit or increment % unit:
        fail("train.rampup_batch_size", ramp, f"start and increment must be multiples of "
              f"micro_batch_size*dp = {unit}, so that every step runs whole micro-batches on "
              "every DP rank")
    if groups_micro_batches(cfg) and start < unit * cfg.pp:
        fail("train.rampup_batch_size", ramp, f"the first step's m = start/(micro_batch_size*dp)"
              f" = {start // unit} micro-batches must be >= pp={cfg.pp} for the interleaved "
              f"schedule (parallel.virtual_stages={cfg.parallel.virtual_stages}); use a start "
              f">= {unit * cfg.pp}")
