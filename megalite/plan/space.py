"""The search's space of layouts (`candidates`) and how a candidate becomes a configuration
(`apply_choice`).

A candidate: tp, cp and pp whose product divides the world size (dp the rest), tp dividing the
heads, the width and the MLP; context parallelism cp a power of two (1, 2, 4, ...) with
seq_len divisible by 2·cp, each cp > 1 with both `parallel.cp_comm`s (allgather, ring); zero
0-3 (1-3 only with dp·cp > 1: ZeRO shards over DP x CP, and with one replica it shards
nothing); sp with tp > 1 (the rank's s/cp positions divisible by tp; with MoE layers sp
only, `sp_options`); virtual stages v > 1
with pp > 1 where pp·v divides the blocks (interleaved with any m >= pp); every
micro-batch size that divides the per-replica batch; the pipeline schedule: 1F1B (interleaved
with v > 1) or, with pp > 1 and v = 1, ZB-H1 (`parallel.schedule=zb-h1`), or, with pp > 1
and 2·pp ≤ n_layer, ZB-V (`parallel.schedule=zb-v`: v = 2 in a V, m need not be a multiple of
pp) — neither with train.compile or activation offload, which the launch refuses with them
(`megalite.config.schedule_rules`); with fp8.recipe, only the tp and micro-batch sizes whose
FP8 products' dimensions are multiples of 16 (`megalite.config.fp8.fp8_dims_refusal`, the
launch's rule); recompute off, of every
block, or of the first r blocks of each chunk (`train.recompute_layers`) for r in
`partial_counts` of the chunk's blocks (a quarter, half and three quarters of them, rounded,
each at least 1 and fewer than all); on GPUs, offload.activations off, or on for every block
not recomputed or for the first `partial_counts` of those (`offload.activations_layers`), and
offload.optimizer at each of `OPTIMIZER_SHARES` (and the configuration's own fraction) — where
the profile gives the host link and host memory bandwidths that price their copies (on CPU the
offloads save nothing). Other keys (bucket size, reshard_after_forward,
overlap_param_gather, edge_stage_layers, ...) are the configuration's own (with
overlap_param_gather the zero stages it refuses, 0 and 3, are left out); with
edge_stage_layers only the pp and v whose pp·v slices can take it (every slice a block: pp = 1
has no edge stage) are tried. For a model with MoE layers, each of these at every
expert-parallel size ep dividing both tp·cp·dp and the experts (`ep_options`) that the
launch's EP rules accept at each schedule (`ep_refused`: the runtime folds ep over a stage's
tensor- (with SP), data- and context-parallel ranks, at any pp).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Tuple

from megalite.config.errors import ConfigError
from megalite.config.expert_parallel import check_expert_parallel
from megalite.config.fp8 import fp8_dims_refusal
from megalite.config.layout import overlap_gather_refuses
from megalite.config.schedule_rules import ZERO_BUBBLE
from megalite.config.schema import CP_COMMS, DEFAULT_RANK_ORDER, RANK_ORDERS, Config
from megalite.config.stage_partition import edge_split_problem, partition_layers

DIM_PROBE = 16  # a micro-batch whose tokens are a multiple of 16: the weights' dimensions alone
PARTIAL_SHARES = (0.25, 0.5, 0.75)  # of a chunk's blocks: partial recompute / offload counts
OPTIMIZER_SHARES = (0.5, 1.0)  # offload.optimizer fractions tried (besides 0)
CELL_FIELDS = ("offload", "offload_optimizer", "offload_layers")  # what a Grid's cells vary


@dataclass(frozen=True)
class Choice:
    tp: int
    pp: int
    dp: int
    zero: int
    sp: bool
    virtual_stages: int
    micro_batch_size: int
    recompute: bool
    offload: bool  # offload.activations
    offload_optimizer: float = 0.0  # offload.optimizer: the fraction of the owned range
    recompute_layers: Optional[int] = None  # with recompute: the first N blocks (None: all)
    offload_layers: Optional[int] = None  # with offload: N blocks after the recomputed ones
    schedule: str = "auto"  # parallel.schedule: auto (1F1B / interleaved), zb-h1 or zb-v
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_comm: str = "allgather"  # parallel.cp_comm (with cp > 1)
    ep: int = 1  # expert parallelism: the experts split over ep of a stage's tp·cp·dp ranks
    rank_order: str = DEFAULT_RANK_ORDER  # parallel.rank_order (`rank_orders`)

    @property
    def zero_bubble(self) -> bool:
        return self.schedule in ZERO_BUBBLE

    @property
    def family(self) -> str:
        """The memory family: ZeRO stage x recompute x offloads."""
        rec = "off" if not self.recompute else "on" if self.recompute_layers is None \
            else "partial"
        return (f"zero={self.zero} recompute={rec}"
                + (" offload.activations" if self.offload else "")
                + (" offload.optimizer" if self.offload_optimizer else ""))

    def overrides(self) -> List[str]:
        """The command-line overrides that select this layout."""
        def opt(x: Optional[int]) -> str:
            return "null" if x is None else str(x)
        return [f"tp={self.tp}", f"cp={self.cp}", f"parallel.cp_comm={self.cp_comm}",
                f"ep={self.ep}", f"parallel.rank_order={self.rank_order}",
                f"pp={self.pp}", f"zero={self.zero}",
                f"sp={str(self.sp).lower()}", f"parallel.virtual_stages={self.virtual_stages}",
                f"parallel.schedule={self.schedule}",
                f"train.micro_batch_size={self.micro_batch_size}",
                f"train.recompute={str(self.recompute).lower()}",
                f"train.recompute_layers={opt(self.recompute_layers)}",
                f"offload.activations={str(self.offload).lower()}",
                f"offload.activations_layers={opt(self.offload_layers)}",
                f"offload.optimizer={self.offload_optimizer:g}"]

    def describe(self) -> str:
        rec = "" if self.recompute_layers is None else f"(first {self.recompute_layers})"
        off = "" if self.offload_layers is None else f"(first {self.offload_layers})"
        cp = f" cp={self.cp} ({self.cp_comm})" if self.cp > 1 else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
        cp += f" order={self.rank_order}" if self.rank_order != DEFAULT_RANK_ORDER else ""
        return (f"tp={self.tp}{cp} pp={self.pp} dp={self.dp} zero={self.zero} sp={self.sp} "
                f"v={self.virtual_stages} mb={self.micro_batch_size} "
                f"recompute={self.recompute}{rec}" + (f" {self.schedule}" if self.zero_bubble else "")
                + (f" offload{off}" if self.offload else "")
                + (f" offload.optimizer={self.offload_optimizer:g}"
                   if self.offload_optimizer else ""))


def apply_choice(cfg: Config, c: Choice) -> Config:
    """`cfg` with the layout keys of `c` (a shallow copy: the sections that change are new)."""
    offload = replace(cfg.offload, activations=c.offload,
                      activations_layers=c.offload_layers if c.offload else None,
                      optimizer=float(c.offload_optimizer))
    return replace(cfg, tp=c.tp, cp=c.cp, pp=c.pp, zero=c.zero, sp=c.sp, ep=c.ep,
                   parallel=replace(cfg.parallel, virtual_stages=c.virtual_stages,
                                    schedule=c.schedule, cp_comm=c.cp_comm,
                                    rank_order=c.rank_order),
                   train=replace(cfg.train, micro_batch_size=c.micro_batch_size,
                                 recompute=c.recompute,
                                 recompute_layers=c.recompute_layers if c.recompute else None),
                   offload=offload)


def offload_fraction(cfg: Config, c: Choice) -> float:
    """offload.optimizer of a candidate."""
    return float(c.offload_optimizer)


def partial_counts(blocks: int) -> List[int]:
    """The partial counts tried for a chunk of `blocks` blocks (module docstring)."""
    return sorted({max(1, math.floor(blocks * s + 0.5)) for s in PARTIAL_SHARES} - {blocks}
                  if blocks > 1 else set())


def chunk_blocks(cfg: Config, pp: int, v: int) -> int:
    """Blocks of the largest model chunk (what recompute_layers / activations_layers count),
    of the partition the run makes (balanced, or with `parallel.edge_stage_layers`)."""
    parts = partition_layers(cfg.model.n_layer, pp * v, cfg.parallel.edge_stage_layers
                             if pp * v > 1 else None)
    return max(len(r) for r in parts)


def memory_options(cfg: Config, blocks: int, offloads: bool
                   ) -> List[Tuple[Tuple[bool, Optional[int]],
                                   List[Tuple[bool, Optional[int]]]]]:
    """Per (recompute, recompute_layers) tried for chunks of `blocks`, the (offload,
    offload_layers) tried with it, fewest offloaded blocks first."""
    out = []
    for rec, r in [(False, None), (True, None)] + [(True, r) for r in partial_counts(blocks)]:
        rest = 0 if rec and r is None else blocks - (r or 0)
        acts = [(False, None)]
        if offloads and rest > 0:
            acts += [(True, k) for k in partial_counts(rest)] + [(True, None)]
        out.append(((rec, r), acts))
    return out


def optimizer_options(cfg: Config, offloads: bool) -> List[float]:
    if not offloads:
        return [0.0]
    own = [cfg.offload.optimizer] if cfg.offload.optimizer else []
    return sorted({0.0, *OPTIMIZER_SHARES, *own})


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _virtual(n_layer: int, pp: int) -> List[int]:
    if pp == 1:
        return [1]
    return [v for v in _divisors(n_layer // pp) if n_layer % (pp * v) == 0] \
        if n_layer % pp == 0 else [1]


def _schedules(cfg: Config, pp: int) -> List[Tuple[int, Tuple[str, ...]]]:
    """(virtual stages, the schedules tried with them) for `pp` stages: auto at every v of
    `_virtual`; with pp > 1 and no compile, ZB-H1 at v = 1 and, where 2·pp <= n_layer, ZB-V at
    v = 2 (whether or not pp·2 divides the blocks)."""
    n_layer, zero_bubble = cfg.model.n_layer, pp > 1 and not cfg.train.compile
    out = {v: ["auto"] for v in _virtual(n_layer, pp)}
    if zero_bubble:
        out[1].append("zb-h1")
        if 2 * pp <= n_layer:
            out.setdefault(2, []).append("zb-v")
    edge = cfg.parallel.edge_stage_layers  # the configuration's own: only where it fits
    return [(v, tuple(names)) for v, names in sorted(out.items())
            if edge is None or not edge_split_problem(n_layer, pp * v, edge)]


@dataclass
class Grid:
    """One layout without its offloads, and its offload variants: `at(i, j)` is the layout
    with the i-th activation offload option (none, then fewer offloaded blocks first) and the
    j-th optimizer fraction (0 first); None where a held field or a refusal (a zero-bubble
    schedule with activation offload) leaves the cell out of the space. Cells are made when asked for."""
    base: tuple  # Choice's fields before its offloads
    recompute_layers: Optional[int]
    schedule: str
    acts: List[Tuple[bool, Optional[int]]]
    fractions: List[float]
    held: list
    cp: int = 1
    cp_comm: str = "allgather"
    ep: int = 1
    rank_order: str = DEFAULT_RANK_ORDER

    @property
    def shape(self) -> Tuple[int, int]:
        return len(self.acts), len(self.fractions)

    def held_out(self) -> bool:
        """Whether a held field that every cell shares (all but the offloads) differs: then
        every cell is None and the grid is left out whole (walking its cells would only
        find that)."""
        c = Choice(*self.base, False, 0.0, self.recompute_layers, None, self.schedule,
                   self.cp, self.cp_comm, self.ep, self.rank_order)
        return any(getattr(c, f) != x for f, x in self.held if f not in CELL_FIELDS)

    def at(self, i: int, j: int) -> Optional[Choice]:
        off, k = self.acts[i]
        if off and self.schedule in ZERO_BUBBLE:
            return None
        c = Choice(*self.base, off, self.fractions[j], self.recompute_layers, k, self.schedule,
                   self.cp, self.cp_comm, self.ep, self.rank_order)
        return c if all(getattr(c, f) == x for f, x in self.held) else None


def cp_options(cfg: Config, world: int) -> List[Tuple[int, str]]:
    """(cp, parallel.cp_comm) tried: cp 1 (with the configuration's comm, which it does not
    use), and each power of two cp > 1 dividing `world` with seq_len divisible by 2·cp,
    with each comm."""
    out, cp = [(1, cfg.parallel.cp_comm)], 2
    while cp <= world and world % cp == 0 and cfg.train.seq_len % (2 * cp) == 0:
        out += [(cp, comm) for comm in CP_COMMS]
        cp *= 2
    return out


def ep_options(cfg: Config, stage_ranks: int) -> List[int]:
    """The ep tried for a stage of `stage_ranks` = tp·cp·dp ranks: every divisor of both it
    and model.moe.num_experts (1 only for a model without MoE layers)."""
    moe = cfg.model.moe
    if not moe.enabled:
        return [1]
    return _divisors(math.gcd(stage_ranks, moe.num_experts))


def sp_options(cfg: Config, tp: int, tokens: int) -> Tuple[bool, ...]:
    """sp tried at `tp` for a rank's `tokens` positions: off, and on where tp > 1 divides
    them; with MoE layers at tp > 1 on only (the launch refuses sp=false there,
    `megalite.config.moe`: each TP rank routes its own tokens)."""
    if tp == 1 or tokens % tp:
        return () if tp > 1 and cfg.model.moe.enabled else (False,)
    return (True,) if cfg.model.moe.enabled else (False, True)


def rank_orders(cfg: Config, sizes: tuple, ep: int) -> Tuple[str, ...]:
    """The rank orders tried at (tp, cp, cp_comm, pp, dp) and `ep`: both where the order
    moves the EP groups (pp > 1 and ep > tp·cp, so an EP group takes several DP indices: the
    reason to pick tp-cp-dp-pp, which keeps it in a node); elsewhere the configuration's
    own, so the dense space (and EP within tp·cp) is not searched twice."""
    tp, cp, _, pp, _ = sizes
    if pp > 1 and ep > tp * cp:
        return RANK_ORDERS
    return (cfg.parallel.rank_order,)


def ep_refused(cfg: Config, sizes: tuple, zero: int, ep: int) -> bool:
    """Whether the launch refuses `ep` at these (tp, cp, cp_comm, pp, dp) and zero
    (`check_expert_parallel`, asked once per grid family rather than per candidate)."""
    tp, cp, _, pp, dp = sizes
    try:
        check_expert_parallel(replace(cfg, tp=tp, cp=cp, pp=pp, zero=zero, ep=ep),
                              tp * cp * pp * dp)
    except ConfigError:
        return True
    return False


def candidate_grids(cfg: Config, world: int, offloads: bool, fixed: Optional[Dict] = None
                    ) -> Iterator[Grid]:
    """The search space (module docstring), with the fields named in `fixed` held, as one
    `Grid` per layout without its offloads."""
    for sizes in layout_sizes(cfg, world):
        yield from layout_grids(cfg, sizes, offloads, fixed)


def layout_sizes(cfg: Config, world: int) -> Iterator[Tuple[int, int, str, int, int]]:
    """Each (tp, cp, cp_comm, pp, dp) of the space: its grids are `layout_grids`'."""
    m, t = cfg.model, cfg.train
    fp8 = cfg.fp8.recipe != "none"
    for tp in _divisors(world):
        if m.n_head % tp or m.n_embd % tp or m.ffn_size % tp:
            continue
        for cp, comm in cp_options(cfg, world // tp):
            tokens = t.seq_len // cp  # a rank's positions of a sequence
            if fp8 and fp8_dims_refusal(m, tp, tokens, DIM_PROBE):
                continue
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > m.n_layer or t.global_batch_size % dp:
                    continue
                yield tp, cp, comm, pp, dp


def layout_grids(cfg: Config, sizes: tuple, offloads: bool, fixed: Optional[Dict] = None
                 ) -> Iterator[Grid]:
    """The grids of one (tp, cp, cp_comm, pp, dp) of `layout_sizes`."""
    yield from _layout_grids(cfg, sizes, offloads, optimizer_options(cfg, offloads),
                             list((fixed or {}).items()))


def _layout_grids(cfg: Config, sizes: tuple, offloads: bool, fractions: List[float],
                  held: list) -> Iterator[Grid]:
    """The grids of one (tp, cp, cp_comm, pp, dp): schedules, zero, sp, micro-batch sizes,
    recompute and offload options."""
    m, t = cfg.model, cfg.train
    tp, cp, comm, pp, dp = sizes
    fp8, tokens = cfg.fp8.recipe != "none", t.seq_len // cp
    eps = ep_options(cfg, tp * cp * dp)
    for (v, schedules), ep in itertools.product(_schedules(cfg, pp), eps):
        options = memory_options(cfg, chunk_blocks(cfg, pp, v), offloads)
        for zero in (range(4) if dp * cp > 1 else (0,)):
            if overlap_gather_refuses(cfg, zero):
                continue
            if ep > 1 and ep_refused(cfg, sizes, zero, ep):
                continue
            named = [x for x in schedules if ep == 1 or not ep_refused(
                replace(cfg, parallel=replace(cfg.parallel, schedule=x)), sizes, zero, ep)]
            for sp in sp_options(cfg, tp, tokens):
                for mb in _divisors(t.global_batch_size // dp):
                    if fp8 and fp8_dims_refusal(m, tp, tokens, mb):
                        continue
                    micro = t.global_batch_size // (mb * dp)
                    runs = [x for x in named if not (x == "auto" and v > 1 and micro < pp)]
                    for (rec, r), acts in options:
                        for name, order in itertools.product(
                                runs, rank_orders(cfg, sizes, ep)):
                            grid = Grid((tp, pp, dp, zero, sp, v, mb, rec), r, name, acts,
                                        fractions, held, cp, comm, ep, order)
                            if not grid.held_out():
                                yield grid


def candidates(cfg: Config, world: int, offloads: bool, fixed: Optional[Dict] = None
               ) -> List[Choice]:
    """Every candidate of the space, flat."""
    out = []
    for grid in candidate_grids(cfg, world, offloads, fixed):
        rows, cols = grid.shape
        out += [c for i in range(rows) for j in range(cols) if (c := grid.at(i, j))]
    return out
