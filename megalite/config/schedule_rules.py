"""Which pipeline schedule (`parallel.schedule`) can run with which layout: checked before
launch by `megalite.config.layout.validate`, each refusal naming the key and what works; what
`auto` resolves to, and each schedule's idle fraction (`expected_bubble`: the formula the
plan, the planner, the metrics and the launch warnings share)."""
from __future__ import annotations

from megalite.config.errors import fail
from megalite.config.schema import PIPELINE_SCHEDULES, Config

ZERO_BUBBLE = ("zb-h1", "zb-v")


def groups_micro_batches(cfg: Config) -> bool:
    """Whether the schedule runs the micro-batches in groups of at least pp (the interleaved
    one, also as auto with virtual_stages > 1: `interleaved_table`), so that m must be >= pp;
    zb-v needs not."""
    return cfg.parallel.virtual_stages > 1 and cfg.parallel.schedule in ("auto", "interleaved")


def check_schedule(cfg: Config) -> None:
    """parallel.schedule x pp x virtual_stages x compile x offload."""
    name, v, pp = cfg.parallel.schedule, cfg.parallel.virtual_stages, cfg.pp
    if name == "interleaved" and v < 2:
        fail("parallel.schedule", name, f"the interleaved schedule runs several model chunks "
              f"per stage: set parallel.virtual_stages >= 2 (now {v}), or use 1f1b / auto")
    if name in ("1f1b", "zb-h1") and v != 1:
        fail("parallel.schedule", name, f"runs one model chunk per stage: set "
              f"parallel.virtual_stages=1 (now {v}), or use interleaved / auto with "
              f"virtual_stages={v}")
    if name == "zb-v" and v != 2:
        fail("parallel.schedule", name, f"runs two model chunks per stage in a V: set "
              f"parallel.virtual_stages=2 (now {v}), or use zb-h1 / 1f1b with virtual_stages=1")
    if name == "zb-v" and 2 * pp > cfg.model.n_layer:
        fail("parallel.schedule", name, f"the V cuts the model into 2*pp = {2 * pp} slices of "
              f"at least one block each, more than model.n_layer={cfg.model.n_layer}; use "
              f"pp <= {cfg.model.n_layer // 2}, or zb-h1 (one slice per stage)")
    if name not in ZERO_BUBBLE:
        return
    if pp < 2:
        fail("parallel.schedule", name, f"a zero-bubble schedule fills a pipeline's idle "
              f"slots and needs pp >= 2 (pp={pp}); use auto or 1f1b")
    if cfg.train.compile:
        fail("parallel.schedule", name, "the zero-bubble schedules split each backward in "
              "two with autograd Functions that torch.compile does not trace (as "
              "torch.distributed.pipelining refuses compile with its zero-bubble schedules); "
              "set train.compile=false, or use 1f1b / interleaved with compile")
    if cfg.offload.activations:
        fail("parallel.schedule", name, "activation offload with a split backward (W runs "
              "after B) is not supported yet; set offload.activations=false, or use 1f1b / "
              "interleaved with offload")


def resolve_schedule(schedule: str, v: int) -> str:
    """The schedule `parallel.schedule=auto` means: interleaved with virtual stages, else 1F1B."""
    if schedule == "auto":
        return "interleaved" if v > 1 else "1f1b"
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {PIPELINE_SCHEDULES}")
    return schedule


def expected_bubble(pp: int, m: int, v: int = 1, schedule: str = "auto") -> float:
    """Idle fraction of a step of `schedule` when a forward, an input gradient (B) and a
    weight gradient (W) take equal time per virtual stage (unsplit, a backward = B + W):
    1F1B and interleaved (p - 1) / (v·m + p - 1); ZB-H1 (p - 1) / (3m + p - 1) for m >= p,
    1 - 3m / (2m + 2p - 1) for m < p; ZB-V, whose chunks are half a stage,
    (p - 1) / (6m + p - 1) for m >= (3p - 1) / 2, else 1 - 6m / (4m + 4p - 2) (see the module
    docstring of `megalite.parallel.schedule`, which runs them)."""
    schedule = resolve_schedule(schedule, v)
    if schedule == "zb-h1":
        return 1 - 3 * m / (3 * m + pp - 1 + max(0, pp - m))
    if schedule == "zb-v":  # in units of one chunk's F, B or W (half a stage's)
        return 1 - 6 * m / (6 * m + max(pp - 1, 4 * pp - 2 * m - 2))
    return (pp - 1) / (v * m + pp - 1)
