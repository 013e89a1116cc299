"""The anchors' expert-parallel layers beside megalite's, at the layer, on the gloo ranks of
`megalite-bench ep`'s world (after its trainers, `expert_parallel._world`), at the trainers'
shape: the model's hidden size, experts, top-k and expert hidden size, seq-len x micro-batch
tokens a rank, fp32, at each ep of `--ep` (EP folded over the world's ranks).

  DeepSpeed-MoE  `deepspeed.moe.layer.MoE(ep_size=ep)` (GShard's top-k gate, its dense
                 dispatch and combine, an all-to-all over its own EP groups, made by
                 `set_deepspeed_parallelism` as its engine makes them), each expert megalite's
                 dense SwiGLU module (`SharedExperts`: down(silu(gate(x)) · up(x))); no
                 Gumbel noise on the second choice (top2_2nd_expert_sampling off),
                 no random token selection (use_rts off); dropless (drop_tokens off: its
                 capacity is the EP ranks' largest count) unless model.moe.capacity_factor is
                 set (then its capacity, which drops by position, not by weight as megalite)
  megatron-core  `MoELayer` with SequentialMLP experts (no Transformer Engine) after
                 `parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)`,
                 with the alltoall and with the allgather dispatcher at the largest ep: built
                 and run once; its router moves its weight to `torch.cuda.current_device()`
                 and its all-to-all dispatcher makes a `torch.cuda.Stream`, so on a CPU it
                 stops there, and the table prints where

An anchor whose module does not import, or whose layer raises, is reported with the error
(its innermost frame inside the anchor's package). One that runs holds the same weights as
megalite's layer (one serial layer seeded alike on every rank; each EP rank its own experts,
by its rank in each framework's own EP group) and takes the same tokens; per ep and layer:

  rel diff     the largest over the layer's output, dL/dx, the router's gradient and the
               rank's experts' gradients of max|megalite's - the anchor's| / max|megalite's|
               after one forward and backward of sum(y * g) (g fixed), the largest rank's
  peak MiB     the layer's parameters + the most bytes that step's allocations hold at once
               (`PeakBytes`, gradients set to None first), the largest rank's
  tokens/s     the world's tokens over the median forward and backward (each from a barrier,
               the slowest rank's), every layer's steps alternated A B .. B A
"""
from __future__ import annotations

import importlib
import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megalite.model.moe.dispatcher import TokenDispatcher
from megalite.model.moe.layer import MoELayer, SharedExperts
from megalite.parallel.topology import build_topology
from megalite_bench.memory import PeakBytes

ANCHORS = (("DeepSpeed-MoE", "deepspeed.moe.layer", "MoE"),
           ("megatron-core", "megatron.core.transformer.moe.moe_layer", "MoELayer"))
EQUAL = 1e-5  # the house's rel for fp32: "equal" below it


def anchor_layers() -> List[dict]:
    """Each anchor's expert-parallel layer: {"name", "module", "error"}; `error` is None where
    the layer's class imports (the import's exception text where it does not)."""
    out = []
    for name, module, attr in ANCHORS:
        try:
            getattr(importlib.import_module(module), attr)
            error = None
        except Exception as e:  # ImportError, or whatever the anchor raises on import here
            error = f"{type(e).__name__}: {e}"
        out.append({"name": name, "module": f"{module}.{attr}", "error": error})
    return out


def error_text(e: BaseException, package: str) -> str:
    """`e` and where it was raised: its innermost frame inside `package` (e.g. megatron/)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"/{package}/" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at {package}/{f.filename.rsplit(f'/{package}/', 1)[1]}:{f.lineno} in " \
                f"{f.name})"
    return f"{type(e).__name__}: {e}{where}"


class DeepSpeedMoE(nn.Module):
    """DeepSpeed-MoE's layer at `ep` (module docstring) with `serial`'s weights; forward -> y."""

    def __init__(self, serial: MoELayer, ep: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        moe, (e, two_inner, hidden) = serial.moe, serial.experts.gate_up_proj.shape
        expert = SharedExperts(hidden, two_inner // 2)  # megalite's SwiGLU, [gate | up]
        self.layer = MoE(hidden, expert, num_experts=e, ep_size=ep,
                         k=moe.top_k, capacity_factor=moe.capacity_factor or 1.0,
                         drop_tokens=moe.capacity_factor is not None, use_rts=False,
                         top2_2nd_expert_sampling=False)
        self.layer.set_deepspeed_parallelism()
        group = self.layer.deepspeed_moe.ep_group
        experts = self.experts()
        first = (dist.get_rank(group) if ep > 1 else 0) * len(experts)
        with torch.no_grad():
            self.router().copy_(serial.gate.weight)
            for j, ex in enumerate(experts):
                ex.gate_up_proj.weight.copy_(serial.experts.gate_up_proj[first + j])
                ex.down_proj.weight.copy_(serial.experts.down_proj[first + j])

    def experts(self) -> List[SharedExperts]:
        return list(self.layer.deepspeed_moe.experts.deepspeed_experts)

    def router(self) -> torch.Tensor:
        return self.layer.deepspeed_moe.gate.wg.weight

    def grads(self) -> Dict[str, torch.Tensor]:
        ex = self.experts()
        return {"router": self.router().grad,
                "gate_up_proj": torch.stack([x.gate_up_proj.weight.grad for x in ex]),
                "down_proj": torch.stack([x.down_proj.weight.grad for x in ex])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


def megalite_grads(layer: MoELayer) -> Dict[str, torch.Tensor]:
    return {"router": layer.gate.weight.grad, "gate_up_proj": layer.experts.gate_up_proj.grad,
            "down_proj": layer.experts.down_proj.grad}


def megalite_layer(serial: MoELayer, rank: int, world: int, ep: int) -> MoELayer:
    """megalite's layer at `ep` (the all-to-all dispatch) with `serial`'s weights."""
    if ep == 1:
        return serial
    topo = build_topology(1, 1, world, rank=rank, ep=ep)
    layer = MoELayer(serial.moe, serial.gate.weight.shape[1], serial.experts.down_proj.shape[2],
                     0, dispatcher=TokenDispatcher(topo.ep_group, "alltoall"))
    local = serial.moe.num_experts // ep
    first = topo.ep_group.rank * local
    with torch.no_grad():
        layer.gate.weight.copy_(serial.gate.weight)
        layer.experts.gate_up_proj.copy_(serial.experts.gate_up_proj[first:first + local])
        layer.experts.down_proj.copy_(serial.experts.down_proj[first:first + local])
    return layer


def megatron_error(serial: MoELayer, ep: int, dispatcher: str) -> Optional[str]:
    """megatron-core's layer at `ep` with `dispatcher`, built and run forward and backward once
    (module docstring): what stops it (None: it ran)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoE
    from megatron.core.transformer.transformer_config import TransformerConfig

    n, two_inner, hidden = serial.experts.gate_up_proj.shape
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=1,
            ffn_hidden_size=two_inner // 2, num_moe_experts=n, moe_router_topk=serial.moe.top_k,
            moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            use_cpu_initialization=True, params_dtype=torch.float32)
        spec = get_moe_module_spec(use_te=False, num_experts=n, moe_grouped_gemm=False)
        y, _ = MegatronMoE(config, spec.submodules)(torch.randn(8, 1, hidden, requires_grad=True))
        y.sum().backward()
        return None
    except Exception as e:  # what stops it here
        return error_text(e, "megatron")
    finally:
        parallel_state.destroy_model_parallel()


def _largest(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item()


def _step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    xi = x.clone().requires_grad_()
    y = layer(xi)
    (y.reshape(g.shape) * g).sum().backward()
    return torch.cat([y.detach().reshape(-1), xi.grad.reshape(-1)])


def _peak(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    layer.zero_grad(set_to_none=True)
    with PeakBytes() as peak:
        _step(layer, x, g)
    return _largest(peak.bytes + sum(p.numel() * p.element_size() for p in layer.parameters()))


def _timed(layers: Dict[tuple, nn.Module], x, g, steps: int) -> Dict[tuple, float]:
    names = list(layers)
    times: Dict[tuple, List[float]] = {n: [] for n in names}
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            _step(layers[name], x, g)
            times[name].append(_largest(time.perf_counter() - t0))
    return {n: statistics.median(v) for n, v in times.items()}


def _deepspeed(serial: MoELayer, eps: List[int], x, g, ours: Dict[int, MoELayer]
               ) -> Dict[int, nn.Module]:
    """DeepSpeed-MoE's layer at each ep, its rel diff to `ours` checked (stored on it)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # its comm over the world already made
    layers = {}
    for ep in eps:
        layer, mine = DeepSpeedMoE(serial, ep), ours[ep]
        for m in (layer, mine):
            m.zero_grad(set_to_none=True)
        out, out_ours = _step(layer, x, g), _step(mine, x, g)
        theirs, own = layer.grads(), megalite_grads(mine)
        layer.rel = _largest(max([_rel(out_ours, out)] + [_rel(own[k], theirs[k]) for k in own]))
        layers[ep] = layer
    return layers


def _agreed(fn: Callable, package: str):
    """fn()'s result, or None and its error where it raised on any rank (the ranks agree)."""
    try:
        result, error = fn(), None
    except Exception as e:  # what stops the anchor here
        result, error = None, error_text(e, package)
    if _largest(error is not None):
        return None, error or "raised on another rank"
    return result, None


def compare(rank: int, world: int, serial: MoELayer, eps: List[int], x: torch.Tensor,
            g: torch.Tensor, steps: int, anchors: List[dict]) -> dict:
    """In the world: {"rows": per ep and layer, "status": {anchor: what it did here}} for the
    anchors that import."""
    ours = {ep: megalite_layer(serial, rank, world, ep) for ep in eps}
    layers = {(ep, "megalite"): ours[ep] for ep in eps}
    runs = {a["name"] for a in anchors if a["error"] is None}
    status: Dict[str, str] = {}
    if "DeepSpeed-MoE" in runs:
        ds, error = _agreed(lambda: _deepspeed(serial, eps, x, g, ours), "deepspeed")
        layers.update({(ep, "DeepSpeed-MoE"): m for ep, m in (ds or {}).items()})
        status["DeepSpeed-MoE"] = "runs here (rows above)" if error is None \
            else f"does not run here: {error}"
    if "megatron-core" in runs:
        errors = {d: megatron_error(serial, max(eps), d) for d in ("alltoall", "allgather")}
        status["megatron-core"] = ("does not run here: " if all(errors.values()) else "") + \
            "; ".join(f"{d} at ep {max(eps)}: " + (e or "builds and runs here, not timed by "
                                                   "this benchmark (its weights not mapped)")
                      for d, e in errors.items())
    peaks = {k: _peak(m, x, g) for k, m in layers.items()}
    seconds = _timed(layers, x, g, steps)
    tokens = x.shape[0] * x.shape[1] * world
    rows = [{"ep": ep, "layer": name, "peak": peaks[(ep, name)],
             "tokens_per_s": tokens / seconds[(ep, name)],
             "rel": getattr(layers[(ep, name)], "rel", None)} for ep, name in layers]
    return {"rows": sorted(rows, key=lambda r: r["ep"]), "status": status}


def compare_lines(rows: List[dict]) -> List[str]:
    """Per ep and layer: peak MiB and tokens/s, each over megalite's at that ep, the rel diff."""
    ours = {r["ep"]: r for r in rows if r["layer"] == "megalite"}
    lines = [f"{'ep':>3} {'layer':<14} {'peak MiB':>9} {'peak/ours':>9} {'tokens/s':>9} "
             f"{'tok/s/ours':>10} {'rel diff':>9}"]
    for r in rows:
        base = ours[r["ep"]]
        rel = "-" if r["rel"] is None else f"{r['rel']:.1e}"
        lines.append(f"{r['ep']:>3} {r['layer']:<14} {r['peak'] / 2**20:>9.2f} "
                     f"{r['peak'] / base['peak']:>9.3f} {r['tokens_per_s']:>9.0f} "
                     f"{r['tokens_per_s'] / base['tokens_per_s']:>10.3f} {rel:>9}")
    rels = [r["rel"] for r in rows if r["rel"] is not None]
    if rels:
        lines.append(f"megalite's layer equals the anchor's (output, dL/dx, router and expert "
                     f"gradients, rel {EQUAL:g}): {'yes' if max(rels) <= EQUAL else 'NO'}")
    return lines


def anchor_lines(anchors: List[dict], status: Dict[str, str]) -> List[str]:
    """Each anchor: why it does not import (not run), or what it did in the world
    (`compare`)."""
    return [f"  {a['name']:<14} {a['module']}: " + (
        f"does not import here, not run: {a['error']}" if a["error"] else status[a["name"]])
        for a in anchors]
