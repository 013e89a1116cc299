"""megalite benchmarks, each side by side with a reference in the same run (ratios, not
absolute times). One subcommand per benchmark; `--help` on each lists its options.

    megalite-bench train --presets tiny gpt2 --seq-len 256 --micro-batch 4
    megalite-bench train --presets gpt2-xl --micro-batch 16 12 8 --compile 0 1   # GPU
    megalite-bench gpu                # everything to measure on one GPU, ~6 minutes

(`python scripts/bench.py ...` in a checkout is the same command.)
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from megalite_bench import (
    attention,
    checkpoint,
    checkpoint_index,
    context_parallel,
    cpu_threads,
    document_attention,
    expert_parallel,
    flight,
    gpu,
    hf_export,
    launch_pipeline,
    loader,
    loss,
    matrix,
    moe,
    offload,
    pipeline,
    plan,
    plan_memory,
    plan_moe_published,
    plan_published,
    plan_table1,
    prepare,
    rerun,
    resilience,
    tensor,
    train,
    zero,
)

BENCHMARKS = {
    "train": (train, "single-device tokens/s, TFLOP/s, MFU against transformers.GPT2LMHeadModel"),
    "attention": (attention, "causal attention fwd+bwd under each SDPA kernel (flash, cuDNN, ...)"),
    "document-attention": (document_attention, "the document mask's kernels (flex, varlen, "
                           "sdpa) fwd+bwd against causal attention, with their errors"),
    "checkpoint": (checkpoint, "checkpoint save / load time and bytes at several DP sizes"),
    "checkpoint-index": (checkpoint_index, "the checkpoint index a resuming rank reads, at N "
                         "simulated ranks"),
    "hf-export": (hf_export, "the streaming transformers export's peak RSS vs shard size, on a "
                  "model larger than the memory cap (and the whole-model read under it)"),
    "pipeline": (pipeline, "1F1B step time and bubble vs m, against torch.distributed.pipelining"),
    "pipeline-launch": (launch_pipeline, "pp through the launch path (build_trainer, fit, the "
                        "resilience defaults on) against torch's Schedule1F1B; --costs: "
                        "the watching features' cost per operation"),
    "tp": (tensor, "tensor/sequence parallel tokens/s and activation memory vs Korthikanti"),
    "zero": (zero, "ZeRO-3 vs FSDP2 and ZeRO-1 vs DDP + ZeroRedundancyOptimizer"),
    "loss": (loss, "the loss alone: the old fp32 cross-entropy vs the chunked one, peak bytes "
                   "(measured and planned) and time"),
    "loader": (loader, "loader start-up time and memory vs corpus size (old vs new sample "
                       "order), open files at 2,000 shards"),
    "prepare": (prepare, "data preparation tokens/s per process vs a datasets.map reference"),
    "plan": (plan, "the planner's predicted step time vs measured on this machine, Spearman"),
    "plan-memory": (plan_memory, "the memory plan's peak vs the peak live bytes of real "
                                 "training steps (CPU or GPU, one or more ranks)"),
    "plan-moe": (plan_moe_published, "the planner's predictions of Megatron-Core's published "
                 "MoE runs (Mixtral 8x22B, Qwen3-235B) against their TFLOP/s"),
    "plan-published": (plan_published, "the planner's TFLOP/s per GPU against published runs "
                       "(Llama 3 405B 8K, Narayanan et al. Table 1) with each row's terms"),
    "plan-table1": (plan_table1, "the planner's layouts and TFLOP/s for Narayanan et al. "
                                 "2021 Table 1 next to the paper's (no device used)"),
    "offload": (offload, "optimizer / activation offload: host AdamW fused vs foreach, step "
                         "time with and without, torchao's CPUOffloadOptimizer on CUDA"),
    "resilience": (resilience, "step time with the replica check and straggler reports vs "
                               "without"),
    "flight": (flight, "step time with the hang dumps' flight recorder vs without"),
    "rerun": (rerun, "step time with rerun attribution vs without, and a suspicious step's"),
    "cp": (context_parallel, "context parallelism on a long sequence: peak bytes per rank (measured "
                             "and planned) and tokens/s at cp 1 2 4, allgather vs ring, against "
                             "torch's context_parallel"),
    "matrix": (matrix, "the combination matrix (--strength 3 before landing an engine change): "
                       "every run against its serial run"),
    "ep": (expert_parallel, "expert parallelism on a tiny MoE at ep 1 2 4 (over dp): peak bytes "
                            "per rank and EP wire bytes against the plan, tokens/s, alltoall "
                            "vs allgather dispatch; the MoE layer beside the anchors' EP "
                            "layers (same weights: compared, timed) or their errors"),
    "moe": (moe, "a tiny MoE training step against its dense model of the same active "
                 "parameters and transformers' MixtralForCausalLM; grouped GEMM against the "
                 "per-expert loop (bf16 on CUDA)"),
    "cpu-threads": (cpu_threads, "the quickstart's CPU step with megalite's choice of intra-op "
                                 "threads vs torch's default, quiet and under a load generator"),
    "gpu": (gpu, "everything to measure on one GPU in one command within a budget (CUDA tests, "
                 "FP8, offload, MFU of the bench and launch paths, document mask, calibration, "
                 "checkpoint, rerun; --resume DIR runs the parts DIR lacks)"),
}


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-bench`: argv (default: the command line) names a benchmark and its options."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
