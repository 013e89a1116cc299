"""Which pipeline schedule (`parallel.schedule`) can run with which layout: checked before
launch by `megalite.layout.validate`, each refusal naming the key and what works."""
from __future__ import annotations

from megalite.config import Config, fail

ZERO_BUBBLE = ("zb-h1", "zb-v")


def groups_micro_batches(cfg: Config) -> bool:
    """Whether the schedule runs the micro-batches in groups of pp (the interleaved one, also
    as auto with virtual_stages > 1), so that m must be a multiple of pp; zb-v needs not."""
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
