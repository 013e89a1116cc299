"""The DCP export and init_from a DCP checkpoint in one process, without torchtitan (which
tests/integration/checkpoint/test_titan.py runs both ways): the weights come back bitwise, the query/key
permutations are each other's inverse, and a DCP checkpoint of another shape is refused
before launch naming the tensor."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.checkpoint.dcp_export import export_dcp, read_titan_state
from megalite.checkpoint.export import model_config
from megalite.checkpoint.format import read_global_state
from megalite.config.errors import ConfigError
from megalite.model.llama.titan import to_interleaved, to_rotate_half
from megalite.train.init_from import check_init_from
from megalite_bench.hf_export import write_checkpoint


def test_dcp_round_trip_is_bitwise_and_shapes_are_checked(tmp_path):
    root = write_checkpoint("llama-tiny", tmp_path / "ckpt")
    export_dcp(root, tmp_path / "titan" / "step-3")
    cfg = model_config(root)
    check_init_from(str(tmp_path / "titan"), cfg)  # the folder of step-N directories
    ours, back = read_global_state(root), read_titan_state(tmp_path / "titan", cfg)
    assert ours.keys() == back.keys()
    assert all(torch.equal(ours[k], back[k]) for k in ours)
    w = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(to_interleaved(w, cfg.n_head), w)
    assert torch.equal(to_rotate_half(to_interleaved(w, cfg.n_head), cfg.n_head), w)
    with pytest.raises(ConfigError, match=r"feed_forward\.w1\.weight has shape \(384, 128\)"):
        check_init_from(str(tmp_path / "titan"), dataclasses.replace(cfg, n_inner=256))
