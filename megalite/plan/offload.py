"""The plan's offload terms (`megalite.plan.memory._stage_plan` applies them to each stage): what
`offload.optimizer = f` moves from the device to host memory, and the PCIe bytes per step of
both offloads — the numbers `megalite.parallel.offload` and `megalite.model.activation_offload`
hold and copy.

With Ψ_o = the elements of the rank's owned optimizer range (Ψ/N where ZeRO shards the
optimizer, else Ψ), n = f·Ψ_o offloaded elements and e the compute dtype's bytes:

  device   O: (8 + 4 if e < 4)·(Ψ_o − n)   (moments, fp32 master where e < 4)
           G: zero 2/3 keep 4·(Ψ_o − n) (their sharded gradient); zero 0/1 unchanged (the
              whole fp32 gradient is accumulated on the device either way)
  host     master 4n + moments 8n + gradient 4n (+ zero 2/3's copy staging 4n)
           (+ the model-dtype cast buffer e·n where e < 4)
  PCIe     device -> host: 4n per reduction (zero 0/1: once per step, zero 2/3: m times);
           host -> device: e·n (the updated parameters);
           activation offload: the offloaded layers' saved tensors, out and back, m times
"""
from __future__ import annotations

from typing import Dict

from megalite.config.layout import Layout
from megalite.config.schema import Config


def owned_elements(layout: Layout, psi: float) -> float:
    """Ψ_o: the elements whose optimizer state one rank holds."""
    return psi / (layout.dp_size if layout.shards_optimizer else 1)


def apply_offload(cfg: Config, layout: Layout, psi: float, e: int, micro: int,
                  state: Dict[str, float], host: Dict[str, float],
                  activations_per_micro: float) -> Dict[str, float]:
    """Move offload.optimizer's share of `state` (device bytes by kind) into `host`, and
    return the PCIe bytes per step by direction. `activations_per_micro`: the host bytes
    one micro-batch's offloaded activations take (over the stage's chunks)."""
    f = cfg.offload.optimizer
    n = f * owned_elements(layout, psi)
    sharded_grads = layout.shards_gradients
    state["optimizer"] *= 1 - f
    if sharded_grads:
        state["grads"] *= 1 - f
    if n:
        host["optimizer"] = (16 + (4 if sharded_grads else 0) + (e if e < 4 else 0)) * n
    reductions = micro if sharded_grads else 1
    return {"d2h": 4 * n * reductions + micro * activations_per_micro,
            "h2d": e * n + micro * activations_per_micro}


def optimizer_placement(cfg: Config, base: str) -> str:
    """The O placement with offload.optimizer (`base`: replicated or sharded over DP)."""
    f = cfg.offload.optimizer
    if not f:
        return base
    master = "fp32 master weights and moments"
    share = "all" if f == 1 else f"{f:.0%} of the owned range"
    return f"{base}, offloaded ({share}: {master}) to host memory"
