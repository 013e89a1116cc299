"""The checks of `megalite-selftest` (megalite/cli/selftest.py): on the world a launch is started
with, a tiny model trained a few steps under every layout class that fits, each against the
serial run (computed on rank 0 of the same job), a checkpoint saved under one layout and
resumed under another, and the links each group uses against the device table
(`megalite.plan.link_check`).

Layout classes (`layout_checks`; a class that does not fit the world is skipped, with why):

    tp<T>, tp<T>-sp      TP inside a node, without and with SP (T: the largest power of two
                         that divides the ranks of a node, the world and the model's heads)
    pp2-1f1b, pp2-interleaved, pp2-zb-h1
                         two pipeline stages under each schedule (DP over the rest)
    cp2, cp2-ring        context parallelism over 2 ranks (DP over the rest), the keys and
                         values all-gathered or passed around the ring (`parallel.cp_comm`)
    zero1, zero3         ZeRO over DP = the world
    combined             TP (as large as fits twice), PP 2, ZeRO-1 over the rest, SP: with a
                         TP group as large as a node, the pipeline's stages are on different
                         nodes
    recompute            (a world of one) activation recomputation: what fits one device

Each layout trains the same steps from the same weights on the same batches as the serial
run; the figure of its check is the largest difference from the serial run over the steps'
losses, gradient norms and parameter norms (relative) and the final fp32 master weights
(elementwise |a - b| / (|b| + atol / rel), which is <= rel exactly where
`torch.testing.assert_close(rtol=rel, atol=atol)` passes): in fp32 rel 1e-5, atol 1e-6 as
the test suite's layouts (tests/layouts.py); in bf16 / fp16 the mixed-precision tolerances
(tests/integration/train/test_mixed_precision.py).

The model and data are the self-test's own: `SELFTEST_MODEL` (4 blocks of 64, 8 heads,
vocabulary 256, sequence 32) on synthetic token shards written to a temporary directory on
every rank (`synthetic_data`; no download, no tokenizer).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megalite.config.layout import Layout, device_type_for
from megalite.config.schema import DEFAULT_RANK_ORDER, Config
from megalite.data.token_arrays import write_token_arrays
from megalite.parallel import comm
from megalite.parallel.topology import build_topology, group_ranks
from megalite.train.launch import plan_launch
from megalite.train.runtime import Runtime, init_runtime

SELFTEST_MODEL = ["model.n_layer=4", "model.n_embd=64", "model.n_head=8",
                  "model.n_positions=64", "model.vocab_size=256", "model.resid_pdrop=0",
                  "model.embd_pdrop=0", "model.attn_pdrop=0"]
SEQ_LEN = 32
# what the runs share besides the model: no evaluation, logging, replica checks or hang watch
# (the comparisons are the checks); the optimizer as the test suite's layouts (optim.eps 1e-6:
# the attention key bias's zero gradient; the default learning-rate warm-up)
SELFTEST_TRAIN = [f"train.seq_len={SEQ_LEN}", "train.micro_batch_size=1", "train.eval_every=0",
                  "train.max_steps=1000", "optim.eps=1e-6", "log.wandb=false",
                  "log.progress=false", "log.every=1", "log.peak_tflops=1",
                  "resilience.check_every=0",
                  "resilience.straggler_report_every=0", "resilience.hang_dump=false"]


@dataclass(frozen=True)
class Tolerance:
    rel: float
    atol: float
    what: str


TOLERANCES = {
    "fp32": Tolerance(1e-5, 1e-6, "fp32: rel 1e-5, atol 1e-6 (tests/layouts.py)"),
    # the mixed-precision test's loss tolerance bounds all figures here: its norm and master
    # bounds (5e-2, 0.25 of the update) are looser than one number can state
    "bf16": Tolerance(3e-3, 3e-3, "bf16: rel 3e-3 (tests/integration/train/test_mixed_precision.py)"),
    "fp16": Tolerance(3e-3, 3e-3, "fp16: rel 3e-3 (tests/integration/train/test_mixed_precision.py)"),
}


@dataclass(frozen=True)
class LayoutCheck:
    name: str
    sets: Tuple[Tuple[str, object], ...]  # (config field path, value)
    what: str

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.sets) or "serial"


def _pow2_divisor(*ns: int) -> int:
    """The largest power of two that divides every n."""
    t = 1
    while all(n % (2 * t) == 0 for n in ns):
        t *= 2
    return t


def layout_checks(world: int, per_node: int, n_head: int = 8, n_layer: int = 4
                  ) -> Tuple[List[LayoutCheck], List[str]]:
    """The layout classes that fit `world` ranks, `per_node` a node, and why the others do
    not."""
    fits, skipped = [], []
    if world == 1:
        return [LayoutCheck("recompute", (("train.recompute", True),),
                            "activation recomputation, one device")], \
            ["tp, pp, cp, zero: a world of one rank (what fits one device runs)"]
    tp = _pow2_divisor(per_node, world, n_head)
    if tp >= 2:
        fits += [LayoutCheck(f"tp{tp}", (("tp", tp),), "TP inside a node"),
                 LayoutCheck(f"tp{tp}-sp", (("tp", tp), ("sp", True)),
                             "TP inside a node, sequence parallel")]
    else:
        skipped.append(f"tp: no group of 2+ ranks divides a node ({per_node} ranks), the world "
                       f"({world}) and the heads ({n_head})")
    if world % 2 == 0 and n_layer % 4 == 0:
        fits += [LayoutCheck("pp2-1f1b", (("pp", 2), ("parallel.schedule", "1f1b")),
                             "PP, 1F1B"),
                 LayoutCheck("pp2-interleaved", (("pp", 2), ("parallel.virtual_stages", 2)),
                             "PP, interleaved 1F1B (2 chunks a stage)"),
                 LayoutCheck("pp2-zb-h1", (("pp", 2), ("parallel.schedule", "zb-h1")),
                             "PP, zero bubble ZB-H1")]
    else:
        skipped.append(f"pp: an odd world ({world}) has no 2 stages")
    if world % 2 == 0 and SEQ_LEN % 4 == 0:  # 2 * cp chunks of every sequence
        fits += [LayoutCheck("cp2", (("cp", 2), ("parallel.cp_comm", "allgather")),
                             "CP, keys and values all-gathered"),
                 LayoutCheck("cp2-ring", (("cp", 2), ("parallel.cp_comm", "ring")),
                             "CP, keys and values passed around the ring")]
    else:
        skipped.append(f"cp: an odd world ({world}) has no 2 CP ranks")
    fits += [LayoutCheck("zero1", (("zero", 1),), "ZeRO-1 over DP"),
             LayoutCheck("zero3", (("zero", 3),), "ZeRO-3 over DP")]
    combined = tp
    while combined >= 2 and world % (2 * combined):
        combined //= 2
    if combined >= 2:
        fits.append(LayoutCheck("combined", (("tp", combined), ("sp", True), ("pp", 2),
                                             ("zero", 1)),
                                "TP + SP inside a node, PP, ZeRO-1 over DP"))
    else:
        skipped.append(f"combined: needs tp >= 2 and pp 2 in the world ({world})")
    return fits, skipped


def crossing_groups(check: LayoutCheck, world: int, per_node: int) -> List[str]:
    """The kinds of the layout's groups that span nodes (nodes of `per_node` ranks)."""
    sets = dict(check.sets)
    tp, pp, cp = int(sets.get("tp", 1)), int(sets.get("pp", 1)), int(sets.get("cp", 1))
    order = str(sets.get("parallel.rank_order", DEFAULT_RANK_ORDER))
    out = []
    for kind, lists in group_ranks(tp, pp, world // (tp * cp * pp), cp, order=order).items():
        if any(len({r // per_node for r in ranks}) > 1 for ranks in lists):
            out.append(kind)
    return out


SERIAL = (("tp", 1), ("cp", 1), ("pp", 1), ("zero", 0), ("sp", False), ("parallel.virtual_stages", 1),
          ("parallel.schedule", "auto"))  # what a layout's settings start from


def micro_batch_size(check: LayoutCheck, world: int, global_batch: int) -> int:
    """A layout's micro-batch: its share of the global batch in as few micro-batches as its
    schedule runs (1; a pipeline 2, one a stage), so that each layout communicates as little
    as it can (gloo ranks sharing a few cores: the collectives cost the time). The serial run
    takes micro-batches of one: the layouts' gradients are the same means over the same
    samples, accumulated in other orders."""
    sets = dict(check.sets)
    dp = world // (int(sets.get("tp", 1)) * int(sets.get("cp", 1)) * int(sets.get("pp", 1)))
    micro_batches = 2 if int(sets.get("pp", 1)) > 1 else 1
    return max(1, global_batch // (dp * micro_batches))


def configure(base: Config, check: Optional[LayoutCheck], **extra) -> Config:
    """`base` under `check`'s layout (None: the serial run; the layout keys of `base` are
    reset first), with `extra` (field path -> value, e.g. checkpoint.resume)."""
    items = list(SERIAL) + (list(check.sets) if check is not None else [])
    return with_settings(base, **dict(items), **extra)


def with_settings(cfg: Config, **settings) -> Config:
    """A copy of `cfg` with `settings` (field path -> value: "train.micro_batch_size")."""
    cfg = copy.deepcopy(cfg)
    for path, value in settings.items():
        obj, *parts = [cfg] + path.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part)
        setattr(obj, parts[-1], value)
    return cfg


# --- data ---------------------------------------------------------------------------------


def synthetic_data(out: Path, vocab: int, tokens: int = 65536, seed: int = 1234) -> Path:
    """Token shards of a seeded random walk over the vocabulary (learnable: the next token is
    near the last), in the prepared-data format (meta.json + uint16 shards). The same bytes on
    every rank."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(-3, 4, size=tokens)
    ids = (np.cumsum(steps) % (vocab - 1) + 1).astype(np.uint16)  # 0 is EOS
    split = int(tokens * 0.9)
    return write_token_arrays(out, {"train": [ids[:split]], "val": [ids[split:]]}, vocab, 0,
                              "synthetic tokens of megalite-selftest")


# --- runs ---------------------------------------------------------------------------------


@dataclass
class Trace:
    """What a run of some steps gives, per step, and its final fp32 master weights."""

    losses: List[float] = field(default_factory=list)
    norms: List[float] = field(default_factory=list)
    param_norms: List[float] = field(default_factory=list)
    saved: Optional[str] = None  # the checkpoint written, if any


def _global_loss(trainer, loss: Optional[float]) -> float:
    """The step's mean loss over the DP x CP ranks (held by the last stage: summed over the
    pipeline first), as every rank sees it."""
    topo, device, group = trainer.topo, trainer.rt.device, trainer.topo.grad_group
    value = 0.0 if loss is None else loss
    value = comm.all_reduce_scalars([value], topo.pp_group, device)[0]
    return comm.all_reduce_scalars([value], group, device)[0] / group.size


def train_steps(trainer, steps: int, save_at: Optional[int] = None) -> Trace:
    """`steps` optimizer steps of `trainer` (checkpointing after step `save_at`)."""
    trace = Trace()
    for _ in range(steps):
        loss, norm = trainer.train_step()
        trace.losses.append(_global_loss(trainer, loss) if loss is not None else math.nan)
        trace.norms.append(norm)
        trace.param_norms.append(trainer.engine.param_norm().item())
        trainer.engine.wait_for_params()
        if save_at is not None and trainer.step == save_at:
            saved = trainer.save()
            trace.saved = None if saved is None else str(saved)
    return trace


def master_pieces(trainer) -> List[Tuple[str, int, int, torch.Tensor]]:
    """This rank's fp32 master ranges: (global name, lo, hi of its flattened TP slice, values
    on the CPU)."""
    return [(seg.spec.name, seg.param_lo, seg.param_hi, piece.detach().float().cpu().clone())
            for piece, seg, _ in trainer.engine.main_params]


def serial_masters(trainer) -> Dict[str, torch.Tensor]:
    """A world of one's master weights as global tensors (vocabulary padding removed)."""
    specs = {s.name: s for s in trainer.model.param_specs.values() if not s.tied_copy}
    flat: Dict[str, list] = {}
    for name, lo, _, values in master_pieces(trainer):
        flat.setdefault(name, []).append((lo, values))
    return {name: specs[name].unshard([torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])])
                                       .view(specs[name].local_shape(1))])
            for name, parts in flat.items()}


def run_serial(cfg: Config, device: torch.device, run_dir: Path, steps: int) -> dict:
    """The serial run (a world of this process alone, inside the launched job): its trace and
    final master weights."""
    layout = Layout.from_config(cfg, 1, device_type_for(cfg.device, None if device.type != "cuda"
                                                        else torch.cuda.device_count()))
    runtime = Runtime(layout=layout, topology=build_topology(1, 1, 1, alone=True),
                      device=device)
    trainer = plan_launch(cfg, 1, layout).build(runtime, run_dir, shared_run_dir=False).trainer
    trace = train_steps(trainer, steps)
    return {"trace": trace, "masters": serial_masters(trainer)}


def _rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def difference(trace: Trace, pieces, layout_trainer, serial: dict, first_step: int,
               tol: Tolerance) -> Tuple[float, str]:
    """This rank's largest difference from the serial run: (figure, which quantity)."""
    ref = serial["trace"]
    worst, where = 0.0, "none"
    for name, ours, theirs in (("loss", trace.losses, ref.losses),
                               ("grad norm", trace.norms, ref.norms),
                               ("parameter norm", trace.param_norms, ref.param_norms)):
        for i, (a, b) in enumerate(zip(ours, theirs[first_step:])):
            d = _rel(a, b)
            if d > worst:
                worst, where = d, f"{name} at step {first_step + i + 1}"
    specs = {s.name: s for s in layout_trainer.model.param_specs.values()}
    topo = layout_trainer.topo
    for name, lo, hi, values in pieces:
        spec = specs[name]
        expect = spec.shard(serial["masters"][name], topo.coords.tp_rank,
                            topo.tp_size).reshape(-1)[lo:hi]
        d = ((values - expect).abs() / (expect.abs() + tol.atol / tol.rel)).max().item() \
            if values.numel() else 0.0
        if not math.isfinite(d):
            d = math.inf
        if d > worst:
            worst, where = d, f"master weights of {name}"
    return worst, where


def worst_over_ranks(figure: float, where: str) -> Tuple[float, str]:
    """The largest figure over the world (default process group) and what it measured."""
    if not dist.is_initialized():
        return figure, where
    gathered: List[Optional[Tuple[float, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (figure, where))
    return max(gathered, key=lambda fw: fw[0] if not math.isnan(fw[0]) else math.inf)


def release(runtime: Runtime) -> None:
    """Destroy a layout's process groups (NCCL communicators hold device memory)."""
    for group in list(runtime.topology.groups.values()):
        if group.pg is not None:
            dist.destroy_process_group(group.pg)


def run_layout(cfg: Config, world: int, run_dir: Path, steps: int, serial: dict,
               tol: Tolerance, save_at: Optional[int] = None, first_step: int = 0
               ) -> dict:
    """Train `cfg`'s layout (validated) and compare with the serial run: the check's figure
    (largest over the ranks), what it was, the checkpoint written at `save_at`."""
    ready = plan_launch(cfg, world)
    runtime = init_runtime(cfg, ready.layout)
    saved = None
    try:
        trainer = ready.build(runtime, run_dir, shared_run_dir=False).trainer
        trace = train_steps(trainer, steps, save_at)
        saved = trace.saved
        figure, where = difference(trace, master_pieces(trainer), trainer, serial, first_step,
                                   tol)
    except Exception as e:  # (a peer blocked in a collective meets its timeout, then here)
        rank = dist.get_rank() if dist.is_initialized() else 0
        figure, where = math.inf, f"{type(e).__name__} on rank {rank}: {e}"
    figure, where = worst_over_ranks(figure, where)
    release(runtime)
    return {"figure": figure, "quantity": where, "saved": saved}


def timed(fn: Callable[[], dict]) -> dict:
    t0 = time.perf_counter()
    out = fn()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out
