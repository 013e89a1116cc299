"""The streaming `transformers` export on a Llama checkpoint (llama-tiny's shape, random weights,
written as `megalite-bench hf-export` writes its big one): shards of at most 2 MiB that
LlamaForCausalLM loads with megalite's logits, each shard read on its own (one read per
shard, only its tensors) and the whole model never gathered."""
from __future__ import annotations

import json

import pytest
import torch

from megalite.checkpoint import export, hf_stream
from megalite.checkpoint.export import export_hf, load_model
from megalite_bench.hf_export import write_checkpoint


def test_llama_exports_in_shards_read_one_at_a_time(tiny_data, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    ckpt = write_checkpoint("llama-tiny", tmp_path / "ckpt")
    reads, read = [], hf_stream.read_tensors

    def recorded(ckpt, meta, names):
        reads.append(list(names))
        return read(ckpt, meta, names)

    def whole(*args, **kwargs):
        raise AssertionError("the export gathered the whole model")

    monkeypatch.setattr(hf_stream, "read_tensors", recorded)
    monkeypatch.setattr(export, "read_global_state", whole)
    out = tmp_path / "hf"
    export_hf(ckpt, out, tokenizer=str(tiny_data / "tokenizer"), max_shard_bytes=2 * 2**20)
    monkeypatch.undo()

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(reads) == len(shards) > 2  # one read per shard, of its own tensors only
    assert sorted(n for names in reads for n in names) == sorted(
        n for n in hf_stream.tensor_shapes(ckpt, json.loads((ckpt / "meta.json").read_text())))
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    ours = load_model(ckpt)
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-5
    with pytest.raises(export.ExportError, match="config.json of an earlier export"):
        export_hf(ckpt, out, tokenizer=str(tiny_data / "tokenizer"), max_shard_bytes=2 * 2**20,
                  part=(0, 2))  # parts into a finished export's directory: refused
