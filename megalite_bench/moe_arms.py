"""The contenders of `megalite-bench moe` (megalite_bench/moe.py), each a callable that runs one
training step (or one MoE layer's forward + backward) on fixed inputs:

    model_configs(args)        the MoE shape and its dense Llama of the same active parameters
    megalite_moe_step(...)     megalite's training path on an MoE shape, with its routing step
    transformers_step(...)     transformers' MixtralForCausalLM, one experts_implementation
    auto_impl(...)             what experts_impl=auto runs here
    layer_pair(...)            one MoE layer as grouped GEMM and as the per-expert loop (the
                               same weights), and their fwd+bwd's largest relative difference
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Tuple

import torch

from megalite.config.model import ModelConfig
from megalite.config.moe import MoEConfig
from megalite.config.schema import load_config
from megalite.model.families import family
from megalite.model.moe.experts import Experts
from megalite.model.moe.layer import MoELayer
from megalite.model.moe.step import clear_routing, routing_step
from megalite_bench.train import Batches, megalite_parts

Step = Callable[[Batches], None]


def model_configs(args) -> Tuple[ModelConfig, ModelConfig]:
    """(the MoE model, its dense Llama): the preset with `--model` overrides, the aux loss
    transformers computes (aux_loss=hf, no z-loss: both sides optimise the same objective), no
    dropout; the dense model is the same Llama whose MLP is top_k experts wide (so its active
    parameters are the MoE's but for the router)."""
    moe_cfg = load_config([f"model={args.preset}", *[f"model.{kv}" for kv in args.model],
                           "model.moe.aux_loss=hf", "model.moe.z_loss_coeff=0",
                           "model.resid_pdrop=0", "model.embd_pdrop=0",
                           "model.attn_pdrop=0"]).model
    width = moe_cfg.moe.top_k * moe_cfg.moe.expert_hidden(moe_cfg.ffn_size)
    dense = replace(moe_cfg, name=f"{moe_cfg.name}-dense", arch="llama", n_inner=width,
                    moe=MoEConfig())
    dense.check()
    return moe_cfg, dense


def megalite_moe_step(mcfg: ModelConfig, device: torch.device, micro_batch: int, seq: int,
                      experts_impl: str) -> Step:
    """megalite's training step (the benchmark path of `megalite-bench train`: schedule, ZeRO
    engine at zero 0, AdamW, clipping) with `experts_impl`, and the trainer's routing step
    (figures, the bias update) between backward and optimizer step, as `Trainer` runs it."""
    if mcfg.moe.enabled:
        mcfg = replace(mcfg, moe=replace(mcfg.moe, experts_impl=experts_impl))
    schedule, engine = megalite_parts(mcfg, device, micro_batch, seq, False, False)

    def step(batches: Batches) -> None:
        clear_routing(schedule.chunks)
        schedule.train_step(batches)
        engine.finish_grad_sync()
        routing_step(schedule.chunks, schedule.topo.grad_group, update=True)
        engine.clip_and_step(1e-4, 1.0)
        engine.zero_grad()
    return step


def transformers_step(mcfg: ModelConfig, device: torch.device, experts: str) -> Step:
    """transformers' MixtralForCausalLM of the same shape, initialised as it does, trained as
    `megalite-bench train` trains its reference (AdamW with decay on matrices, clipping at 1.0;
    bf16 autocast on CUDA), with its aux loss (output_router_logits) and the experts computed
    by `experts` (its experts_implementation: eager, grouped_mm, batched_mm)."""
    import transformers

    mapping = family(mcfg).hf
    torch.manual_seed(0)
    hf_cfg = mapping.hf_config(mcfg)
    hf_cfg.output_router_logits = True
    hf_cfg._attn_implementation = "sdpa"  # the attention kernel megalite uses
    model_class = getattr(transformers, mapping.model_class)
    model = model_class._from_config(hf_cfg, experts_implementation=experts).to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, **extra)
    autocast = device.type == "cuda"

    def step(batches: Batches) -> None:
        for x, _ in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=x, labels=x).loss  # the LM loss + coeff · aux loss
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def transformers_experts_implementations() -> List[str]:
    """The experts implementations this transformers has, eager first (grouped_mm where its
    interface offers it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager"] + [n for n in ("grouped_mm",) if n in ALL_EXPERTS_FUNCTIONS.valid_keys()]


def auto_impl(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str:
    """What megalite's experts_impl=auto runs on `device` in `dtype`: grouped or loop."""
    with torch.device("meta"):
        experts = Experts(replace(mcfg.moe, experts_impl="auto"), mcfg.n_embd,
                          mcfg.moe.expert_hidden(mcfg.ffn_size)).to(dtype)
    return "grouped" if experts.grouped(torch.empty(1, mcfg.n_embd, device=device,
                                                   dtype=dtype)) else "loop"


def _layer(mcfg: ModelConfig, impl: str, device, dtype) -> MoELayer:
    moe = replace(mcfg.moe, experts_impl=impl)
    torch.manual_seed(0)
    layer = MoELayer(moe, mcfg.n_embd, mcfg.ffn_size, 0).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, mcfg.initializer_range)
    return layer.to(dtype)


def layer_pair(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, tokens: int
               ) -> Tuple[Dict[str, Callable[[], object]], float]:
    """One MoE layer of the model's shape as grouped GEMM and as the loop, the same weights
    and inputs ([tokens, 1, h]): their fwd+bwd callables and the largest relative difference
    (output, input and weight gradients). Refuses (ValueError) a layer grouped GEMM does not
    take here (torch._grouped_mm missing, or sizes not 16-byte aligned)."""
    layers = {impl: _layer(mcfg, impl, device, dtype) for impl in ("grouped", "loop")}
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, 1, mcfg.n_embd, generator=g, device=device, dtype=dtype)
    x.requires_grad_()
    dy = torch.randn(tokens, 1, mcfg.n_embd, generator=g, device=device, dtype=dtype)
    if not layers["grouped"].experts.grouped(x):
        raise ValueError(f"torch._grouped_mm does not take this layer here ({dtype}, "
                         f"{device.type}, n_embd={mcfg.n_embd}, expert size "
                         f"{mcfg.moe.expert_hidden(mcfg.ffn_size)})")

    def fwd_bwd(layer: MoELayer) -> Tuple[torch.Tensor, ...]:
        out = layer(x)
        return (out, *torch.autograd.grad(out, (x, *layer.parameters()), dy))

    got = [fwd_bwd(layers[impl]) for impl in ("grouped", "loop")]
    rel = max(((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
              for a, b in zip(*got))
    return {impl: (lambda m=m: fwd_bwd(m)) for impl, m in layers.items()}, rel
