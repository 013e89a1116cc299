"""The first line of metrics.jsonl: what the run is (layout, model, batch, plan, model-state
bytes, data, where it starts), written by rank 0's `MetricsWriter`, made here."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalite.config.schema import Config
from megalite.eval.choice import ChoiceEval
from megalite.model.stage import PipelineStage
from megalite.parallel import comm
from megalite.parallel.zero import ZeroEngine
from megalite.plan.memory import Plan
from megalite.train.metrics import MetricsWriter, Peak, fp8_peak
from megalite.train.runtime import Runtime


@dataclass(frozen=True)
class ModelCounts:
    """The model's size and cost as its family counts them (`megalite.model.family.Family`):
    parameters (a tied embedding once, no padding) and training FLOPs per token at the run's
    train.seq_len, with the formula's name."""

    parameters: int
    flops_per_token: int  # of the active parameters (MoE: top-k routed and shared experts)
    flops_formula: str
    active_parameters: Optional[int] = None  # MoE: those a token passes; None = parameters


def build_writer(cfg: Config, rt: Runtime, run_dir: Path, model: PipelineStage,
                 engine: ZeroEngine, *, sources: Sequence[Tuple[Path, float]], data_meta: dict,
                 peak: Peak, start_step: int, hellaswag: Optional[ChoiceEval],
                 planner: Optional[dict], plan: Plan, counts: ModelCounts
                 ) -> Optional[MetricsWriter]:
    """Rank 0's metrics writer, its header written (None on the other ranks). Collective:
    the model-state bytes are gathered from every stage."""
    state_bytes = gather_state_bytes(engine, rt.topology, rt.device)
    if rt.topology.rank != 0:
        return None
    header = run_header(cfg, rt, run_dir, model, sources=sources, data_meta=data_meta,
                        peak=peak, state_bytes=state_bytes, start_step=start_step,
                        hellaswag=hellaswag, planner=planner, plan=plan, counts=counts)
    log = cfg.log
    return MetricsWriter(run_dir, header, log.wandb, log.project, log.run_name, asdict(cfg),
                         cfg.train.max_steps, start_step, log.progress)


def gather_state_bytes(engine: ZeroEngine, topo, device: torch.device) -> List[dict]:
    """Model-state bytes (parameters, gradients, optimizer) per pipeline stage, the most any
    rank of the stage holds, for the run header: a maximum over the stage's TP, CP and DP ranks,
    then one summary per stage gathered to rank 0 (O(pp) objects there, not O(world))."""
    mine = engine.state_bytes()
    kinds = list(mine)
    values = [float(mine[k]) for k in kinds]
    for group in (topo.tp_group, topo.grad_group):
        values = comm.all_reduce_scalars(values, group, device, op=dist.ReduceOp.MAX)
    summary = {"pp": topo.coords.pp_rank, "ranks": topo.tp_size * topo.grad_group.size,
               **{k: int(v) for k, v in zip(kinds, values)}}
    gathered = comm.gather_objects_to_root(summary, topo.pp_group)
    return gathered if gathered is not None else []


def run_header(cfg: Config, rt: Runtime, run_dir: Path, model: PipelineStage, *,
               sources: Sequence[Tuple[Path, float]], data_meta: dict, peak: Peak,
               state_bytes: List[dict], start_step: int, hellaswag: Optional[ChoiceEval],
               planner: Optional[dict], plan: Plan, counts: ModelCounts) -> dict:
    """The header of a run of `cfg` on `rt`, starting at `start_step`; `plan`: the launch's;
    `counts`: the model's parameters and FLOPs per token."""
    m, t, layout = cfg.model, cfg.train, rt.layout
    return {
        "layout": layout.as_dict(),
        "stages": [[[r.start, r.stop] for r in chunks] for chunks in layout.stage_blocks()],
        "micro_batches": layout.micro_batches(t.global_batch_size),
        "model": {"name": m.name, "arch": m.arch, "n_layer": m.n_layer, "n_embd": m.n_embd,
                  "n_head": m.n_head, "n_positions": m.n_positions,
                  "ffn_size": m.ffn_size, "tie_word_embeddings": m.tie_word_embeddings},
        "dropout_on": any(p > 0 for p in (m.resid_pdrop, m.embd_pdrop, m.attn_pdrop)),  # model.*_pdrop
        "vocab_size": m.vocab_size, "padded_vocab_size": model.padded_vocab,
        "tokenizer_vocab_size": data_meta["vocab_size"],
        "parameters": counts.parameters,
        "active_parameters": counts.active_parameters or counts.parameters,
        "flops_per_token": counts.flops_per_token,
        "flops_formula": counts.flops_formula,
        "attention_mask": t.attention_mask,
        "mfu_attention_flops": "dense: the 12*L*h*s attention term of flops_formula, whatever "
                               "train.attention_mask" + (
                                   "; the attention FLOPs computed within documents are each "
                                   "line's attention_flops_masked (per step), beside "
                                   "attention_flops_in_mfu" if t.attention_mask == "document"
                                   else ""),
        "peak_tflops_per_device": peak.tflops, "peak_source": peak.source,
        "fp8": fp8_peak(cfg.fp8.recipe, rt.device),
        "device": str(rt.device), "compute_dtype": str(rt.compute_dtype),
        "seq_len": t.seq_len, "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "model_state_bytes": state_bytes,
        "plan": plan.as_dict(),
        "planner": planner,
        "data_dir": str(sources[0][0]),
        "data_sources": [[str(d), w] for d, w in sources],
        "run_dir": str(run_dir),
        "start_step": start_step,
        "hellaswag": None if hellaswag is None else {
            "source": cfg.eval.hellaswag, "examples": len(hellaswag.choices.labels),
            "length": hellaswag.length, "truncated_endings": hellaswag.choices.truncated},
    }
