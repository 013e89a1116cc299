"""The device a single-process command (generate, evaluate) runs on when none is named."""
from __future__ import annotations


def default_device() -> str:
    """"cuda" where this process sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
