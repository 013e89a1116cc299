"""The export round trip the families' tests share: a model initialised and saved as a
transformers directory, and its logits and greedy text held to transformers' on that
directory."""
from __future__ import annotations

from pathlib import Path

import torch

from megalite.config.model import ModelConfig
from megalite.model.families import causal_lm
from megalite.model.hf_io import save_hf
from megalite.model.init import init_parameters


def export_initialized(cfg: ModelConfig, path: Path) -> tuple:
    """A model of `cfg` initialised (seed 3, eval mode), its global state by transformers'
    names, saved with `save_hf` at `path`: (model, state)."""
    ours = causal_lm(cfg).eval()
    init_parameters(ours, seed=3)
    state = {ours.param_specs[n].name: ours.param_specs[n].unshard([p.detach()])
             for n, p in ours.named_parameters()}
    save_hf(state, cfg, path)
    return ours, state


def assert_logits_and_greedy_text_equal(ours, hf, ids: torch.Tensor, prompt: int = 5,
                                        new: int = 8) -> None:
    """`ours` and transformers' `hf` give the same logits on `ids` (1e-5) and, from the first
    sequence's first `prompt` tokens, the same `new` greedy tokens (`hf.generate`)."""
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-5
        theirs = hf.generate(ids[:1, :prompt], max_new_tokens=new,
                             do_sample=False)[0, prompt:].tolist()
        seq = ids[0, :prompt].tolist()
        for _ in range(new):
            seq.append(ours(torch.tensor([seq]))[0, -1].argmax().item())
    assert seq[prompt:] == theirs
