"""Every CUDA-only branch of megalite/ — a branch on the live device: `<x>.type == "cuda"` (or
"cpu", whose other side is the GPU's), `.is_cuda`, a `cuda` flag, `torch.cuda.is_available()` —
by the function holding it, and the single-GPU test that runs it (a test of a
tests/*/*/test_cuda*.py file, skipped without a GPU; `megalite-bench gpu`'s cuda-tests part runs
them all). The few that only NCCL between two GPUs reaches name why instead. A branch on a
configured device *name* (`layout.device_type == "cuda"`, `cfg.device`) is not one: the CPU
tests pass such names. test_gpu_tests_hold.py finds the branches in the source and holds this
list to them both ways: a new CUDA branch without a test fails there, naming it."""
from __future__ import annotations

PARALLEL_CUDA = "tests/unit/parallel/test_cuda.py::"
OPT_OFFLOAD = "tests/unit/parallel/test_cuda_optimizer_offload.py::"
ACT_OFFLOAD = "tests/unit/model/test_cuda_offload.py::"
BRANCHES = "tests/unit/parallel/test_cuda_device_branches.py::"
COMMANDS = "tests/integration/cli/test_cuda_commands.py::"
CALIBRATE = "tests/unit/plan/test_cuda_calibrate.py::"

TRAIN = PARALLEL_CUDA + "test_reduced_precision_training_with_fp32_master_weights"
PRETRAIN = COMMANDS + "test_pretrain_on_one_gpu_and_its_resume"
SELFTEST = COMMANDS + "test_the_selftest_on_one_gpu"
PROFILE = CALIBRATE + "test_single_process_calibration_on_cuda_writes_host_figures"
ACT_FORWARD = ACT_OFFLOAD + "test_offloaded_forward_frees_device_memory_and_gives_the_same_gradients"
OPT_ORDER = OPT_OFFLOAD + "test_gradient_copies_start_during_the_backward_and_parameters_return_in_order"
OPT_EQUAL = OPT_OFFLOAD + "test_fp32_parameters_equal_the_run_without_offload"

SINGLE_GPU = {
    "megalite.checkpoint.save:take_snapshot":
        PARALLEL_CUDA + "test_background_save_from_the_gpu_equals_a_save_in_the_loop",
    "megalite.cli.calibrate:calibrate_command":
        COMMANDS + "test_a_single_process_calibration_on_one_gpu",
    "megalite.cli.selftest:_init_group": SELFTEST,
    "megalite.cli.selftest:_checked": SELFTEST,
    "megalite.data.loader:_to_batch": PRETRAIN,
    "megalite.model.activation_offload:ActivationOffload.__init__":
        ACT_OFFLOAD + "test_copies_go_to_pinned_memory_on_a_side_stream",
    "megalite.model.activation_offload:ActivationOffload._copied_out_event": ACT_FORWARD,
    "megalite.model.activation_offload:_SavedBlock._copy_out": ACT_FORWARD,
    "megalite.model.activation_offload:_SavedBlock.forward_done": ACT_FORWARD,
    "megalite.model.activation_offload:_SavedBlock.unpack": ACT_FORWARD,
    "megalite.model.activation_offload:_SavedBlock.restore": ACT_FORWARD,
    "megalite.model.activation_offload:_SavedBlock.__del__":
        ACT_OFFLOAD + "test_host_copies_are_pinned_as_counted_and_reused",
    "megalite.model.init:_generator": TRAIN,
    "megalite.parallel.calls:launch": "tests/integration/resilience/test_cuda_hang.py::"
                                      "test_a_stuck_cuda_stream_is_named_though_its_host_launched",
    "megalite.parallel.calls:wait_for": "tests/integration/resilience/test_cuda_hang.py::"
                                        "test_a_stuck_cuda_stream_is_named_though_its_host_launched",
    "megalite.parallel.context_attention:_allgather_attention":
        "tests/unit/parallel/test_cuda_context_attention.py::"
        "test_one_ranks_chunks_by_lower_right_sdpa_equal_full_attention",
    "megalite.parallel.fp8:scaled_product": "tests/unit/parallel/test_cuda_fp8.py::"
                                            "test_cublas_scaled_products_are_the_dequantised_reference",
    "megalite.parallel.group:CollectiveWaits.timed":
        BRANCHES + "test_collective_waits_are_the_streams_stall",
    "megalite.parallel.group:CollectiveWaits.position":
        BRANCHES + "test_collective_waits_are_the_streams_stall",
    "megalite.parallel.group:CollectiveWaits.between":
        BRANCHES + "test_collective_waits_are_the_streams_stall",
    "megalite.parallel.offload:OptimizerOffload.__init__":
        OPT_OFFLOAD + "test_host_state_is_pinned_and_copies_use_a_side_stream",
    "megalite.parallel.offload:OptimizerOffload._copy_in": OPT_ORDER,
    "megalite.parallel.offload:OptimizerOffload.drain": OPT_ORDER,
    "megalite.parallel.offload_params:HostParams.step": OPT_ORDER,
    "megalite.parallel.offload_params:HostParams._to_device": OPT_ORDER,
    "megalite.parallel.offload_params:HostParams.params_needed": OPT_ORDER,
    "megalite.parallel.offload_params:HostParams.gather_after_copy": OPT_EQUAL,
    "megalite.parallel.offload_params:HostParams.params_to_device": PRETRAIN,  # the resume
    "megalite.parallel.offload_timeline:OffloadTimeline.begin":
        "tests/unit/bench/test_cuda_bench.py::test_variants_are_freed_and_waits_are_device_time",
    "megalite.parallel.offload_worker:HostWorker._cuda_index": OPT_ORDER,
    "megalite.parallel.rng:_get_state": BRANCHES + "test_the_rng_streams_live_on_the_gpus_generator",
    "megalite.parallel.rng:_set_state": BRANCHES + "test_the_rng_streams_live_on_the_gpus_generator",
    "megalite.parallel.rng:seeded_state":
        BRANCHES + "test_the_rng_streams_live_on_the_gpus_generator",
    "megalite.parallel.zero:ZeroEngine._build_optimizer": TRAIN,
    "megalite.plan.calibrate:device_dtypes": PROFILE,
    "megalite.plan.calibrate:_sync": PROFILE,
    "megalite.plan.calibrate:device_name": PROFILE,
    "megalite.plan.calibrate:device_memory_bytes": PROFILE,
    "megalite.plan.calibrate:_launch_device": PROFILE,
    "megalite.plan.calibrate:measure_profile": PROFILE,
    "megalite.plan.calibrate:_measure": PROFILE,
    "megalite.plan.calibrate:_block_overhead": PROFILE,
    "megalite.plan.calibrate:_document_masks": PROFILE,
    "megalite.plan.calibrate_block:time_block.one": PROFILE,
    "megalite.plan.calibrate_mask:time_attention.one": PROFILE,
    "megalite.plan.link_check:table_for": BRANCHES + "test_the_link_checks_table_entry_is_this_gpus",
    "megalite.resilience.deterministic:use_deterministic_kernels": PRETRAIN,
    "megalite.resilience.stragglers:where_this_rank_runs": PRETRAIN,
    "megalite.train.host_threads:set_host_threads": PRETRAIN,
    "megalite.train.host_threads:set_cpu_threads": PRETRAIN,
    "megalite.train.metrics:fp8_peak": BRANCHES + "test_an_fp8_runs_peak_is_read_for_this_gpu",
    "megalite.train.metrics:peak_tflops": PARALLEL_CUDA + "test_peak_comes_from_the_device_table",
    "megalite.train.metrics:peak_memory_bytes": PRETRAIN,
    "megalite.train.profiling:StepProfiler.step": PRETRAIN,
    "megalite.train.profiling:StepProfiler.close": PRETRAIN,
    "megalite.train.resilience_services:build_resilience": PRETRAIN,
    "megalite.train.runtime:Runtime.synchronize": PRETRAIN,
    "megalite.train.runtime:local_gpus": PRETRAIN,
    "megalite.train.runtime:local_gpu": PRETRAIN,
    "megalite.train.runtime:init_runtime": PRETRAIN,
    "megalite.train.selftest:run_serial": SELFTEST,
    "megalite.utils.clock:DeviceClock.mark":
        "tests/unit/bench/test_cuda_bench.py::test_variants_are_freed_and_waits_are_device_time",
    "megalite.utils.clock:DeviceClock.seconds":
        "tests/unit/bench/test_cuda_bench.py::test_variants_are_freed_and_waits_are_device_time",
    "megalite.utils.clock:thread_cuda_device": PRETRAIN,  # the hang watch's thread
    "megalite.utils.device:default_device":
        BRANCHES + "test_a_single_process_command_defaults_to_the_gpu",
}

# only NCCL between ranks on two GPUs reaches these (one GPU cannot hold two NCCL ranks)
SEVERAL_GPUS = {
    "megalite.parallel.comm:send_recv": "the pipeline's point-to-point transfers between stages",
    "megalite.parallel.offload:OptimizerOffload.on_launched":
        "the side stream waiting on a DP reduction's NCCL handle (a group of one has none)",
    "megalite.parallel.offload:OptimizerOffload.on_reduced":
        "a DP reduction's NCCL completion releasing its source",
    "megalite.plan.calibrate:measure_links": "the links' sweep over two or more ranks",
    "megalite.plan.calibrate_links:_sync": "the links' sweep over two or more ranks",
    "megalite.plan.link_check:measure_link": "the self-test's link check between GPUs",
    "megalite.plan.link_check:judge": "the self-test's link check between GPUs",
}

BENCH_MOE = "tests/unit/bench/test_cuda_bench.py::" \
            "test_moe_bench_times_grouped_gemm_in_bf16_against_the_loop"
# megalite_bench's CUDA-only branches with a single-GPU test (test_gpu_tests_hold.py holds
# megalite_bench/ to these and to BENCH_BEFORE_THE_RULE both ways: a new branch needs a test)
BENCH_SINGLE_GPU = {
    "megalite_bench.moe:add_arguments": BENCH_MOE,
    "megalite_bench.moe:run": BENCH_MOE,
    "megalite_bench.moe_arms:transformers_step": BENCH_MOE,
    "megalite_bench.timing:synchronize": BENCH_MOE,
}
# the benchmarks' branches from before that rule, run on a GPU by `megalite-bench gpu` itself
# (its parts) but not (yet) by a test of their own; none may be added here
BENCH_BEFORE_THE_RULE = {
    "megalite_bench.attention:add_arguments", "megalite_bench.attention:run",
    "megalite_bench.document_attention:add_arguments", "megalite_bench.document_attention:run",
    "megalite_bench.gpu:run", "megalite_bench.gpu_worker:measure",
    "megalite_bench.gpu_worker:parser", "megalite_bench.loss:add_arguments",
    "megalite_bench.memory:PeakBytes.__enter__", "megalite_bench.memory:PeakBytes.__exit__",
    "megalite_bench.memory:_replay", "megalite_bench.memory:live_tensor_bytes",
    "megalite_bench.offload:_free", "megalite_bench.offload:run",
    "megalite_bench.offload:step_times", "megalite_bench.offload:time_variant",
    "megalite_bench.offload_variants:parse_variants", "megalite_bench.plan_memory:_rank",
    "megalite_bench.timing:peak_memory", "megalite_bench.timing:reset_peak",
    "megalite_bench.train:add_arguments", "megalite_bench.train:megalite_parts",
    "megalite_bench.train:profile_step", "megalite_bench.train:run",
    "megalite_bench.train:transformers_step",
}
