"""Exports that cannot lose a finished one (llama-tiny's shape, random weights, written as
`megalite-bench hf-export` writes its big one): an export cut short inside its writing or
inside its swap leaves the finished export it replaces whole (HF and DCP); the parts of an
export refuse another export's files and pin one step of a checkpoint directory; shards
follow the umask; a data directory is named as one."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpoint import export_parts, hf_stream
from megalite.checkpoint.dcp_export import export_dcp, read_titan_state
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.export import ExportError, export_hf, model_config
from megalite.checkpoint.export_parts import RECORD
from megalite_bench.hf_export import write_checkpoint

SHARD = 2 * 2**20  # llama-tiny in 2 MiB shards: more than two


class Crash(Exception):
    """The process dies here."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A checkpoint directory with step 0, and the same weights as a later step elsewhere."""
    root = tmp_path_factory.mktemp("ckpts")
    ckpt = write_checkpoint("llama-tiny", root / "run")
    later = root / "later" / "step_00000001"
    shutil.copytree(ckpt, later)
    return {"root": root / "run", "step0": ckpt, "step1": later}


def crash_renaming(monkeypatch, prefix: str) -> None:
    """os.replace of a directory named `prefix`... (the new export moving into place) dies."""
    replace = os.replace

    def crashing(src, dst):
        if Path(src).name.startswith(prefix):
            raise Crash(f"killed renaming {src}")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing)


def test_hf_export_cut_short_keeps_the_finished_one(ckpts, tiny_data, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    out, tok = tmp_path / "hf", str(tiny_data / "tokenizer")
    export_hf(ckpts["step0"], out, tokenizer=tok)
    (out / "README.md").write_text("the finished export")
    before = load_file(out / "model.safetensors")

    def dies(*args):
        raise Crash("killed writing the configs")

    monkeypatch.setattr(hf_stream, "write_configs", dies)  # inside the writing
    with pytest.raises(Crash):
        export_hf(ckpts["step0"], out, tokenizer=tok, force=True)
    monkeypatch.undo()
    crash_renaming(monkeypatch, ".hf.tmp")  # inside the swap: the old one set aside
    with pytest.raises(Crash):
        export_hf(ckpts["step0"], out, tokenizer=tok, force=True)
    monkeypatch.undo()
    with pytest.raises(ExportError, match="exists and is not empty"):  # put back, not replaced
        export_hf(ckpts["step0"], out, tokenizer=tok)
    assert (out / "README.md").read_text() == "the finished export"
    after = load_file(out / "model.safetensors")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    LlamaForCausalLM.from_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing left beside it


def test_dcp_export_cut_short_keeps_the_finished_one(ckpts, tmp_path, monkeypatch):
    out, cfg = tmp_path / "titan", model_config(ckpts["step0"])
    export_dcp(ckpts["step0"], out)
    (out / "README.md").write_text("the finished export")
    before = read_titan_state(out, cfg)

    def dies(*args, **kwargs):
        raise Crash("killed inside dcp.save")

    import torch.distributed.checkpoint as dcp  # what export_dcp imports when it runs

    monkeypatch.setattr(dcp, "save", dies)
    with pytest.raises(Crash):
        export_dcp(ckpts["step0"], out, force=True)
    monkeypatch.undo()
    crash_renaming(monkeypatch, ".titan.dcp-partial")
    with pytest.raises(Crash):
        export_dcp(ckpts["step0"], out, force=True)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_dcp(ckpts["step0"], out)
    assert (out / "README.md").read_text() == "the finished export"
    after = read_titan_state(out, cfg)
    assert all(torch.equal(after[k], before[k]) for k in before)
    export_dcp(ckpts["step0"], out, force=True)  # and replaced when asked
    assert not (out / "README.md").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["titan"]


def shard_exports(out: Path):
    return {p.name: export_parts.shard_export(p) for p in sorted(out.glob("model*.safetensors"))}


def test_parts_refuse_another_exports_shards(ckpts, tiny_data, tmp_path):
    out, tok = tmp_path / "hf", str(tiny_data / "tokenizer")
    export_hf(ckpts["step0"], out, tok, max_shard_bytes=SHARD, part=(0, 2))
    for other, shard in ((ckpts["step1"], SHARD), (ckpts["step0"], SHARD // 2)):
        with pytest.raises(CheckpointError, match="holds the parts of another export"):
            export_hf(other, out, tok, max_shard_bytes=shard, part=(1, 2))
    (out / RECORD).unlink()  # as the part completing an export leaves it, cut short after
    with pytest.raises(CheckpointError, match="model-00001-of-.*a shard of another export"):
        export_hf(ckpts["step1"], out, tok, max_shard_bytes=SHARD, part=(1, 2))
    assert not (out / hf_stream.INDEX).exists()
    export_hf(ckpts["step0"], out, tok, max_shard_bytes=SHARD, part=(1, 2))  # its own: joins
    assert (out / hf_stream.INDEX).exists() and not (out / RECORD).exists()


def test_parts_given_a_checkpoint_directory_pin_one_step(ckpts, tiny_data, tmp_path):
    """A save landing between the parts' starts: the later part exports the first's step."""
    root, out, tok = tmp_path / "checkpoints", tmp_path / "hf", str(tiny_data / "tokenizer")
    shutil.copytree(ckpts["step0"], root / "step_00000000")
    old = os.umask(0o022)
    try:
        first = export_hf(root, out, tok, max_shard_bytes=SHARD, part=(0, 2))
        shutil.copytree(ckpts["step1"], root / "step_00000001")
        second = export_hf(root, out, tok, max_shard_bytes=SHARD, part=(1, 2))
    finally:
        os.umask(old)
    assert first.name == second.name == "step_00000000"
    index = json.loads((out / hf_stream.INDEX).read_text())
    ids = shard_exports(out)
    assert sorted(ids) == sorted(set(index["weight_map"].values())) and len(ids) > 2
    assert set(ids.values()) == {export_parts.export_id(first, SHARD, 2)}
    assert {oct(p.stat().st_mode & 0o777) for p in out.glob("model*")} == {"0o644"}  # umask


def test_exporting_a_data_directory_says_so(tiny_data, tmp_path):
    with pytest.raises(CheckpointError, match="a prepared data directory .*, not a checkpoint"):
        export_hf(tiny_data, tmp_path / "hf")


def test_dcp_names_come_from_the_family(tmp_path):
    gpt2 = write_checkpoint("tiny", tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match=r"model.arch=gpt2 \(GPT-2\) has no DCP names; "
                       r"DCP checkpoints are written and read for model.arch=llama"):
        export_dcp(gpt2, tmp_path / "titan")
