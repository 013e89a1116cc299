"""Rotary position embedding (Su et al. 2021), as `transformers`' Llama computes it: the
rotate-half convention (a head's first half of dimensions paired with its second half, not
interleaved pairs), inverse frequencies θ^(-2i/d) from `model.rope_theta`, and Llama 3's
frequency scaling where `model.rope_scaling` names it (rope_type "llama3": wavelengths above
original_max_position_embeddings / low_freq_factor divided by `factor`, those below
original / high_freq_factor kept, the band between interpolated smoothly).

The inverse frequencies are computed on the CPU in fp32, as transformers does, and moved to
the model's device: the same bits wherever the model lives. cos and sin are made per forward
from the positions 0..s-1 (the whole sequence: with sequence parallelism q and k come out of a
column-parallel projection of the gathered sequence) in fp32, then cast to the activations'
dtype (transformers' order of operations). With context parallelism the positions are those of
the rank's chunks of the sequence (`megalite.parallel.context_shard.positions`); with
train.reset_positions, per sequence, positions that restart at each document.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from megalite.config.model import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 on the CPU: θ^(-2i/d), Llama 3-scaled where configured."""
    dim = cfg.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the given (integer) positions, in `dtype`: [len(positions), head_dim] of
    positions [s]; [b, 1, s, head_dim] (broadcast over heads) of positions [b, s] (restarting
    per document)."""
    freqs = positions.to(inv_freq.device, torch.float)[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:
        emb = emb.unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., s, head_dim] rotated by position: x·cos + rotate_half(x)·sin."""
    return x * cos + rotate_half(x) * sin
