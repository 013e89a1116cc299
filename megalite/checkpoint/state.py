"""What a checkpoint holds besides the engine's tensors: the run's stateful parts, listed once.

Every object whose state a checkpoint keeps implements `state_dict()` / `load_state_dict()`
(torchtitan's `Stateful` contract) and is named once in the run's `RunState`
(`megalite.train.run_state` lists a training run's parts). A save writes what `capture()`
takes from the list; a restore hands every part its entry back, in list order. Neither reads
or writes an entry by hand, so a part added to the list is saved and restored with no change to
`megalite.checkpoint.save` or `load`. Where a part's state goes:

    TOP    meta.json, at the top level: the part's keys (the progress: "step" and
           "skipped_steps", where checkpoints kept them before this list existed);
           restored from the whole meta
    META   meta.json["<name>"], the same on every rank (null while the part is off in this
           run, e.g. no loss scale without fp16); restored from meta.get(name) (None from a
           checkpoint written before the part existed)
    RANK   <name>_rank<r>.pt, this rank's own (the random streams: `rng_rank<r>.pt`); restored
           only when the checkpoint's layout is this run's, else the part gets None

The engine's tensors (fp32 master weights, AdamW's moments and step) are no part: they are
written piece by piece and resharded onto any layout (`megalite.checkpoint.save`, `load`).
"""
from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence

import numpy as np
import torch

from megalite.checkpoint.format import RECORD_KEYS
from megalite.utils.log import get_logger

TOP, META, RANK = "top", "meta", "rank"
RESEED_STRIDE = 1_000_003  # a resumed run's fresh device streams: seed + stride * step


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: Optional[dict]) -> None: ...


@dataclass(frozen=True)
class Part:
    """One named stateful part of a run. `obj` None: off in this run (a META part's entry is
    then null, a RANK part writes no file)."""
    name: str
    obj: Optional[Stateful]
    where: str = META  # TOP, META or RANK (the module docstring)


@dataclass
class Progress:
    """The run's optimizer steps taken and how many of them were skipped (a non-finite
    gradient, or a batch resilience.rerun judged bad data). Kept at meta.json's top level."""
    step: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            raise ValueError("a checkpoint without its step: nothing to resume")
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])


class ProcessRNG:
    """This process's random streams: the model's dropout streams (`RNGTracker`) and torch's
    CPU, NumPy's and Python's global generators. Restored from a checkpoint of this layout and
    device type; else the device's streams restart from `seed` and the step `progress` was
    restored to (restore it first: `RunState` restores in list order)."""

    def __init__(self, tracker, seed: int, progress: Progress):
        self.tracker, self.seed, self.progress = tracker, seed, progress

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "torch_cpu": torch.get_rng_state(),
                "numpy": np.random.get_state(), "python": random.getstate(),
                "device_type": self.tracker.device.type}

    def accepts(self, state: dict) -> bool:
        """Whether `state` was saved on this device type: a CUDA generator's state cannot seed
        a CPU one (nor the reverse). States written before the device type was recorded tell
        by the size of the replicated stream's state."""
        if "device_type" in state:
            return state["device_type"] == self.tracker.device.type
        return state["tracker"]["replicated"].numel() == \
            self.tracker.state_dict()["replicated"].numel()

    def load_state_dict(self, state: Optional[dict]) -> None:
        """`state` None: the checkpoint was written under another layout (fresh device streams
        from the seed and the step). From another device type, the host generators are
        restored (the same kind everywhere) and the device's streams restart likewise."""
        same_device = state is not None and self.accepts(state)
        if state is not None and not same_device:
            get_logger().warning(
                f"the checkpoint was written on {state.get('device_type', 'another')}"
                f" devices, this run is on {self.tracker.device.type}: everything is restored "
                "but the device's dropout streams, which restart from the seed and the step")
        if state is not None:
            if same_device:
                self.tracker.load_state_dict(state["tracker"])
            torch.set_rng_state(state["torch_cpu"])
            np.random.set_state(state["numpy"])
            random.setstate(state["python"])
        if not same_device:
            self.tracker.reseed(self.seed + RESEED_STRIDE * self.progress.step)


@dataclass
class SavedState:
    """The parts' states as of one step, copied (training may go on meanwhile)."""
    meta: dict  # meta.json's entries of the parts, the same on every rank
    rank_files: Dict[str, dict]  # a RANK part's name -> this rank's state

    @property
    def step(self) -> int:
        if "step" not in self.meta:
            raise ValueError("a checkpoint is of a step: the run state lists no part that "
                             "records one (`Progress`, at the top level)")
        return int(self.meta["step"])


class RunState:
    """The stateful parts of a run, each named once; save and restore walk this list."""

    def __init__(self, parts: Sequence[Part]):
        names = [p.name for p in parts]
        clash = [n for n in names if names.count(n) > 1 or n in RECORD_KEYS]
        if clash:
            raise ValueError(f"run state parts {sorted(set(clash))}: each part needs its own "
                             f"name, none of meta.json's own entries {list(RECORD_KEYS)}")
        for p in parts:
            if p.where not in (TOP, META, RANK):
                raise ValueError(f"run state part {p.name!r}: where={p.where!r} is not one of "
                                 f"{TOP!r}, {META!r}, {RANK!r}")
            if p.where == TOP and p.obj is None:
                raise ValueError(f"run state part {p.name!r}: a top-level part cannot be off")
        self.parts: List[Part] = list(parts)

    @property
    def rank_files(self) -> List[str]:
        """The RANK parts that are on: the per-rank files a save writes and a restore reads."""
        return [p.name for p in self.parts if p.where == RANK and p.obj is not None]

    def capture(self) -> SavedState:
        meta: dict = {}
        files: Dict[str, dict] = {}
        for p in self.parts:
            if p.where == TOP:
                top = p.obj.state_dict()
                taken = [k for k in top if k in meta or k in RECORD_KEYS
                         or any(k == q.name for q in self.parts)]
                if taken:
                    raise ValueError(f"run state part {p.name!r}: its keys {taken} are "
                                     "another part's or meta.json's own")
                meta.update(_json(p.name, top))
            elif p.where == META:
                meta[p.name] = None if p.obj is None else _json(p.name, p.obj.state_dict())
            elif p.obj is not None:
                files[p.name] = p.obj.state_dict()
        return SavedState(copy.deepcopy(meta), copy.deepcopy(files))

    def restore(self, meta: dict, rank_files: Dict[str, Optional[dict]]) -> None:
        """Every part from a checkpoint's `meta` and this rank's `rank_files` (a name ->
        None where the checkpoint's layout differs, or it has no such file), in list order."""
        for p in self.parts:
            if p.obj is None:
                continue
            if p.where == TOP:
                p.obj.load_state_dict(meta)
            elif p.where == META:
                p.obj.load_state_dict(meta.get(p.name))
            else:
                p.obj.load_state_dict(rank_files.get(p.name))


def _json(name: str, state: dict) -> dict:
    """`state`, refused before any rank writes when meta.json could not hold it (rank 0 alone
    would fail to publish)."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"run state part {name!r}: its state goes to meta.json and must be "
                         f"JSON (a tensor belongs in a per-rank part): {e}") from e
    return state
