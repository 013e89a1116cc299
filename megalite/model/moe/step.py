"""Once per optimizer step: the step's routing counts summed over every rank that saw other
tokens, the aux-loss-free bias updated from them, and the figures logged per MoE layer.

    counts_le = assignments to expert e in layer l, over the step's micro-batches and every
                rank that holds other tokens: DP × CP (`grad_group`) and, under sequence
                parallelism, TP (each rank records its own tokens' part, `ledger`); PP ranks
                see other layers
    bias_le  += bias_update_rate · sign(mean_e counts_le − counts_le)   (DeepSeek-V3)

Figures (`metrics.jsonl`'s "moe", per MoE layer by block index): aux (the Switch / Megatron
layer value E·Σ f·P, mean over the step's forwards and ranks), z_loss (likewise), imbalance
(max / mean of the step's counts: 1 is perfect balance), dropped (the fraction of assignments
over capacity), bias_min / bias_max (after the update); with aux_loss=hf `aux_hf`, the pooled
value (mean over forwards and ranks).

Under pipeline parallelism each stage (each of its chunks: a chunk without an MoE layer has no
ledger and no bias) updates its own layers' biases from their counts over its DP × CP ranks;
the figures of every stage's layers are then gathered over the pipeline group, so the logging
rank logs the whole model's, as a single stage would."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalite.model.moe.ledger import RoutingLedger, StepFigures
from megalite.parallel import comm
from megalite.parallel.group import Group


def _packed(f: StepFigures) -> torch.Tensor:
    return torch.cat([f.counts.reshape(-1), f.aux, f.z, f.dropped, f.assigned, f.pooled,
                      f.pooled.new_tensor([f.forwards])])


def _unpacked(t: torch.Tensor, layers: int, experts: int) -> Dict[str, torch.Tensor]:
    n = layers * experts
    parts = t[n:].split([layers] * 4 + [1, 1])
    return {"counts": t[:n].view(layers, experts), "aux": parts[0], "z": parts[1],
            "dropped": parts[2], "assigned": parts[3], "pooled": parts[4][0],
            "forwards": parts[5][0]}


def update_bias(router_bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """bias += rate · sign(mean − counts) of one layer (in place, fp32)."""
    router_bias += rate * torch.sign(counts.mean() - counts).to(router_bias.dtype)


def finish_step(ledgers: List[RoutingLedger], biases: List[Dict[int, torch.Tensor]],
                group: Group, update: bool) -> Optional[dict]:
    """After a step's forwards and backwards: the figures of every MoE layer of this rank's
    chunks (`ledgers`; `biases` each chunk's {block index: its router's bias}), summed over
    the TP group where SP split the tokens (`ledger.split`), then over `group` (DP × CP); the
    biases updated where `update` (the step is applied). Clears the ledgers. Collective over
    those groups wherever a chunk has MoE layers (every rank of a stage alike); None where
    none has."""
    figures = {}
    for ledger, bias in zip(ledgers, biases):
        if ledger.figures is None:
            ledger.clear()
            continue
        layers, experts = len(ledger.layers), ledger.moe.num_experts
        packed = _packed(ledger.figures)
        if ledger.split.tp is not None:  # SP: each TP rank recorded its own tokens' part
            comm.all_reduce(packed, ledger.split.tp)
        if group.size > 1:
            comm.all_reduce(packed, group)
        got = _unpacked(packed, layers, experts)
        if update and ledger.moe.bias_update_rate > 0:
            for row, layer in enumerate(ledger.layers):
                update_bias(bias[layer], got["counts"][row], ledger.moe.bias_update_rate)
        # the figures and the biases' ranges (after the update): one copy to the host
        ranges = [torch.stack([bias[layer].min(), bias[layer].max()]).to(packed.dtype)
                  for layer in ledger.layers if layer in bias]
        host = torch.cat([packed, *ranges]).cpu()
        got = _unpacked(host[:packed.numel()], layers, experts)
        ranged = iter(host[packed.numel():].view(-1, 2).tolist())
        # a micro-batch's forward was recorded by each of the ranks its tokens are split over
        forwards = (got["forwards"] / ledger.split.ranks).clamp(min=1)
        for row, layer in enumerate(ledger.layers):
            figures[str(layer)] = _layer_figures(got, row, got["counts"][row], forwards,
                                                 next(ranged) if layer in bias else None)
        if ledger.moe.aux_loss == "hf":
            figures["aux_hf"] = (got["pooled"] / forwards).item()
        ledger.clear()
    return figures or None


def _layer_figures(got: Dict[str, torch.Tensor], row: int, counts: torch.Tensor,
                   forwards: torch.Tensor, bias_range: Optional[List[float]]) -> dict:
    out = {"aux": (got["aux"][row] / forwards).item(),
           "z_loss": (got["z"][row] / forwards).item(),
           "imbalance": (counts.max() / counts.mean().clamp(min=1e-12)).item(),
           "dropped": (got["dropped"][row] / got["assigned"][row].clamp(min=1)).item()}
    if bias_range is not None:
        out["bias_min"], out["bias_max"] = bias_range
    return out


def _ledgers_and_biases(chunks) -> Tuple[List[RoutingLedger], List[Dict[int, torch.Tensor]]]:
    from megalite.model.moe.layer import MoELayer

    ledgers, biases = [], []
    for chunk in chunks:
        if chunk.routing is None:
            continue
        ledgers.append(chunk.routing)
        biases.append({m.index: m.gate.e_score_correction_bias for m in chunk.modules()
                       if isinstance(m, MoELayer) and m.gate.e_score_correction_bias is not None})
    return ledgers, biases


def model_moe_layers(chunks) -> List[int]:
    """The block indices of the whole model's MoE layers (every stage's chunks alike)."""
    chunk = chunks[0]
    ledger = chunk.family.routing_ledger(chunk.cfg, range(chunk.cfg.n_layer))
    return [] if ledger is None else ledger.layers


FIGURES = ("aux", "z_loss", "imbalance", "dropped", "bias_min", "bias_max")


def stages_figures(figures: Optional[dict], layers: List[int], has_bias: bool,
                   pp_group: Group, device: torch.device) -> dict:
    """Every stage's figures (`figures` this stage's, None where it has no MoE layer) on every
    rank of the pipeline group: each MoE layer of the model (`layers`; `has_bias`: their
    routers have a selection bias) is one stage's, the others' rows are zeros, so the sum over
    the group is each layer's figures, bit for bit. The pooled aux_loss=hf value is not
    (pp > 1 refuses it: config/moe.py)."""
    mine = figures or {}
    table = torch.tensor([[mine.get(str(layer), {}).get(key, 0.0) for key in FIGURES]
                          for layer in layers], dtype=torch.float64, device=device)
    comm.all_reduce(table, pp_group)
    keys = FIGURES if has_bias else FIGURES[:4]
    rows = table.cpu().tolist()
    return {str(layer): dict(zip(keys, rows[row])) for row, layer in enumerate(layers)}


def clear_routing(chunks) -> None:
    """Forget the figures recorded so far (before a step runs, or runs again)."""
    for ledger in _ledgers_and_biases(chunks)[0]:
        ledger.clear()


def routing_step(chunks, group: Group, update: bool, pp_group: Optional[Group] = None,
                 device: Optional[torch.device] = None) -> Optional[dict]:
    """`finish_step` of a rank's model chunks (`megalite.model.stage.PipelineStage.chunks`):
    the biases of this stage's MoE layers updated from their counts over `group` (DP x CP);
    with a `pp_group` of several stages, the figures of every stage's MoE layers on every rank
    (`stages_figures` on `device`; collective over the pipeline group where the model has MoE
    layers, whether this stage has any or not). None where no figure is."""
    ledgers, biases = _ledgers_and_biases(chunks)
    figures = finish_step(ledgers, biases, group, update) if ledgers else None
    if pp_group is None or pp_group.size == 1:
        return figures
    layers = model_moe_layers(chunks)
    if not layers:
        return None
    return stages_figures(figures, layers, chunks[0].cfg.moe.has_bias, pp_group, device)


class RouterBiases:
    """The routers' selection biases of a rank's chunks as a run-state part (meta.json's
    "moe_bias": {block index: [E floats]}; every DP × CP rank holds the same values, updated
    from the same summed counts). fp32 values go through JSON's float exactly. A checkpoint
    without them (none yet: an MoE run without a bias) restores zeros, the starting bias.

    Each pipeline stage holds its own layers' biases: `state_dict` gathers every stage's over
    `pp_group` (collective over it; a save captures the state on every rank) into the whole
    model's, the same on every rank whoever writes meta.json, and a restore takes this
    stage's layers' (so a checkpoint resumes under any pp)."""

    def __init__(self, chunks, pp_group: Optional[Group] = None,
                 device: Optional[torch.device] = None):
        self.biases: Dict[int, torch.Tensor] = {}
        for bias in _ledgers_and_biases(chunks)[1]:
            self.biases.update(bias)
        self.layers, self.experts = model_moe_layers(chunks), chunks[0].cfg.moe.num_experts
        self.pp_group, self.device = pp_group, device

    @classmethod
    def of(cls, chunks, pp_group: Optional[Group] = None,
           device: Optional[torch.device] = None) -> Optional["RouterBiases"]:
        """The part of `chunks` (every stage's, whether it holds MoE layers or not), None
        where the model's routers have no bias."""
        if not (model_moe_layers(chunks) and chunks[0].cfg.moe.has_bias):
            return None
        return cls(chunks, pp_group, device)

    def state_dict(self) -> dict:
        table = torch.zeros(len(self.layers), self.experts, dtype=torch.float64,
                            device=self.device)  # fp64 holds each bias exactly
        for row, layer in enumerate(self.layers):
            if layer in self.biases:
                table[row] = self.biases[layer]
        if self.pp_group is not None and self.pp_group.size > 1:
            comm.all_reduce(table, self.pp_group)  # one stage's rows each, zeros elsewhere
        rows = table.cpu().tolist()
        return {str(layer): rows[row] for row, layer in enumerate(self.layers)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        for i, bias in self.biases.items():
            values = None if state is None else state.get(str(i))
            with torch.no_grad():
                if values is None:
                    bias.zero_()
                else:
                    bias.copy_(torch.tensor(values, dtype=bias.dtype))
