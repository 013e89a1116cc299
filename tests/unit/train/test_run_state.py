"""One list of saved state (`megalite.checkpoint.state.RunState`, a training run's parts in
`megalite.train.run_state`): what a save writes besides the engine's tensors is what the list
captures, a restore hands every part of the list its entry back, and a part added to the list
is saved and restored with no change to the checkpoint code."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import pytest
import torch

from megalite.checkpoint.format import RECORD_KEYS, read_meta
from megalite.checkpoint.state import META, RANK, TOP, Part, RunState
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.run_state import restore
from megalite.train.runtime import init_runtime
from megalite.train.trainer import Trainer
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT


def _trainer(tiny_data, run_dir, *extra) -> Trainer:
    cfg = load_config(TINY + FP32_NO_DROPOUT + [
        f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"checkpoint.dir={run_dir.parent / 'ckpt'}", *extra])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


def same(a, b) -> bool:
    """Equal states: dicts, sequences, tensors and arrays compared element by element."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


class Counter:
    """A stateful part that is not megalite's: what a newcomer would add. `tensor`: its
    state holds one (a per-rank part's may; meta.json holds JSON)."""

    def __init__(self, n: int = 0, tensor: bool = False):
        self.n, self.tensor = n, tensor
        self.loaded: list = []  # every state it was handed

    def state_dict(self) -> dict:
        return {"n": self.n, **({"t": torch.arange(self.n)} if self.tensor else {})}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.loaded.append(state)
        if state is not None:
            self.n = state["n"]


def test_parts_are_named_once_and_apart_from_the_checkpoints_own_entries():
    with pytest.raises(ValueError, match="own name"):
        RunState([Part("a", Counter()), Part("a", Counter(), RANK)])
    with pytest.raises(ValueError, match="meta.json's own entries"):
        RunState([Part("layout", Counter())])
    with pytest.raises(ValueError, match="cannot be off"):
        RunState([Part("progress", None, TOP)])
    with pytest.raises(ValueError, match="must be JSON"):
        RunState([Part("c", Counter(2, tensor=True))]).capture()
    state = RunState([Part("c", Counter(2)), Part("off", None),
                      Part("mine", Counter(1, tensor=True), RANK), Part("gone", None, RANK)])
    saved = state.capture()
    assert saved.meta["off"] is None and set(saved.rank_files) == {"mine"}
    assert state.rank_files == ["mine"]
    with pytest.raises(ValueError, match="records one"):
        saved.step


@pytest.mark.slow
def test_every_entry_a_save_writes_is_restored_through_the_list(tiny_data, second_data,
                                                                 tmp_path, monkeypatch):
    """fp16 (the loss scale), resilience.rerun (its statistics), a batch ramp (a function of
    the data position) and a blend (per-dataset counts): meta.json holds the checkpoint's
    record and the list's entries, nothing else; resuming hands every part its own entry and
    rng_rank00000.pt, and the resumed parts capture what was saved."""
    extra = ["precision=fp16", "optim.warmup_steps=0", "resilience.rerun=on_spike",
             "resilience.spike_warmup=1", "train.rampup_batch_size=[4,4,16]",
             f"data.blend=[1,{tiny_data},1,{second_data}]"]
    trainer = _trainer(tiny_data, tmp_path / "a", *extra)
    for _ in range(3):
        trainer.train_step()
    saved = trainer.state.capture()
    path = trainer.save()
    meta = read_meta(path)
    assert set(meta) - set(RECORD_KEYS) == set(saved.meta) == \
        {"step", "skipped_steps", "sampler", "loss_scaler", "rerun"}
    assert all(meta[k] is not None for k in saved.meta), meta  # every part is on here
    assert sorted(p.name for p in path.glob("*_rank*.pt")) == ["rng_rank00000.pt"]

    handed: Dict[str, object] = {}
    original = RunState.restore

    def spy(state: RunState, meta: dict, rank_files: dict) -> None:
        for part in state.parts:  # record what each part is handed
            load = part.obj.load_state_dict
            monkeypatch.setattr(part.obj, "load_state_dict",
                                lambda s, name=part.name, load=load: (handed.update({name: s}),
                                                                      load(s))[1])
        original(state, meta, rank_files)

    monkeypatch.setattr(RunState, "restore", spy)
    resumed = _trainer(tiny_data, tmp_path / "b", *extra, f"checkpoint.resume={path}")
    assert set(handed) == {p.name for p in resumed.state.parts}
    for part in resumed.state.parts:
        want = meta if part.where == TOP else meta.get(part.name) if part.where == META \
            else torch.load(path / f"{part.name}_rank00000.pt", weights_only=False)
        assert same(handed[part.name], want), part.name
    again = resumed.state.capture()
    assert again.meta == saved.meta
    assert same(again.rank_files["rng"]["tracker"], saved.rank_files["rng"]["tracker"])
    assert resumed.batch_size.at(resumed.sampler.consumed_samples) == \
        trainer.batch_size.at(trainer.sampler.consumed_samples)  # the ramp continues


@pytest.mark.slow
def test_a_part_added_to_the_list_is_saved_and_restored(tiny_data, tmp_path):
    """No change to save or load: a new META part lands in meta.json under its name, a new
    RANK part in <name>_rank00000.pt, and both come back; from a checkpoint written before
    the parts existed they get None (and keep their state)."""
    trainer = _trainer(tiny_data, tmp_path / "a", "checkpoint.resume=auto")
    trainer.train_step()
    older = trainer.save()  # without the new parts
    trainer.train_step()
    extended = RunState(trainer.state.parts + [Part("counter", Counter(3)),
                                              Part("mine", Counter(5, tensor=True), RANK)])
    path = trainer.saver.save(trainer.engine, extended.capture())
    assert read_meta(path)["counter"]["n"] == 3 and (path / "mine_rank00000.pt").is_file()

    fresh = RunState(trainer.state.parts + [Part("counter", Counter()), Part("mine", Counter(),
                                                                            RANK)])
    restore(trainer.cfg, trainer.ckpt_root, trainer.engine, trainer.topo, fresh)  # resume=auto
    counter, mine = fresh.parts[-2].obj, fresh.parts[-1].obj
    assert (counter.n, mine.n) == (3, 5) and trainer.step == 2

    for stale in sorted(trainer.ckpt_root.glob("step_*"))[1:]:  # the latest is the older one
        stale.rename(trainer.ckpt_root / f"later_{stale.name}")
    assert sorted(p.name for p in trainer.ckpt_root.glob("step_*")) == [older.name]
    before = RunState(trainer.state.parts + [Part("counter", Counter(7)),
                                            Part("mine", Counter(9), RANK)])
    restore(trainer.cfg, trainer.ckpt_root, trainer.engine, trainer.topo, before)
    counter, mine = before.parts[-2].obj, before.parts[-1].obj
    assert (counter.loaded, mine.loaded) == ([None], [None]) and (counter.n, mine.n) == (7, 9)
    assert trainer.step == 1
