"""Which pipeline schedule (`parallel.schedule`) can run with which layout: checked before
launch by `megalite.layout.validate`, each refusal naming the key and what works."""
from __future__ import annotations

from megalite.config import Config, fail

ZERO_BUBBLE = ("zb-h1", "zb-v")


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
    if name == "zb-v":
        fail("parallel.schedule", name, "running the zb-v schedule (V placement, two chunks "
              "per rank, the tied embedding as one parameter on rank 0) is not built yet (its "
              "order is, in megalite.parallel.schedule); use zb-h1 (zero bubble, one chunk per "
              "stage), 1f1b or interleaved")
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
