"""What `megalite-bench gpu` runs (`megalite_bench.gpu`): its parts in order of priority, and
the sizes of the full form (one GPU) and of the reduced one (tiny, CPU: the test suite's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

# by what has never run on a GPU first: the CUDA tests, FP8's speed, the offload's timeline;
# then the measured-before (mfu; calibrate after it: it predicts mfu's steps)
PARTS = ("cuda-tests", "fp8", "offload", "mfu", "document-mask", "calibrate", "checkpoint",
         "rerun")
PHASES = ("data", "forward_backward", "grad_sync", "optimizer")
RESILIENCE_OFF = ["resilience.check_every=0", "resilience.straggler_report_every=0",
                  "resilience.hang_dump=false", "resilience.hang_signal=null"]
NO_DROPOUT = ["model.resid_pdrop=0", "model.embd_pdrop=0", "model.attn_pdrop=0"]
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """What the parts run: the full form on a GPU, the reduced one (tiny, CPU) in tests."""

    presets: Dict[str, List[str]]  # name -> model overrides
    micro_batch: Dict[str, int]
    micro_batches: int
    seq_len: int
    compiles: Tuple[bool, ...]
    bench_steps: int
    bench_warmup: int
    launch_skip: int  # records not timed (compilation, warm-up)
    launch_steps: int  # records timed
    preset_dropout: List[str]  # the overrides of a run at "the preset's dropout"
    big: str  # the preset of the offload sweep, the calibration and the equal-dropout run
    small: str  # the preset of the checkpoint and rerun parts
    offload: List[str]  # megalite-bench offload's options
    calibrate: List[str]
    document_mask: List[str]  # megalite-bench document-attention's options
    limits: Dict[str, float]  # seconds per run kind
    device: List[str]  # the launch path's device override


FULL = Sizes(
    presets={"gpt2": ["model=gpt2"], "gpt2-xl": ["model=gpt2-xl"]},
    micro_batch={"gpt2": 16, "gpt2-xl": 16}, micro_batches=4, seq_len=1024,
    compiles=(True, False), bench_steps=3, bench_warmup=2, launch_skip=2, launch_steps=3,
    preset_dropout=[], big="gpt2-xl", small="gpt2",
    offload=["--preset", "gpt2-xl", "--micro-batch", "8", "--micro-batches", "4", "--steps",
             "3", "--warmup", "1", "--baseline-every", "2", "--skip-adam",
             "--variants", "1", "0:act", "--act-fit-gib", "44"],
    calibrate=["model=gpt2-xl", "train.seq_len=1024", "train.micro_batch_size=4"],
    document_mask=["--preset", "llama3-8b", "--seq-len", "8192", "--document-tokens", "512",
                   "2048", "8192", "--steps", "5", "--warmup", "2"],
    limits={"cuda-tests": 300, "document-mask": 150, "bench": 90, "bench-compiled": 150, "launch": 90,
            "launch-compiled": 150, "offload": 200, "calibrate": 90, "checkpoint": 80,
            "rerun": 70, "prepare": 90},
    device=[])

TINY = ["model=tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
        "model.n_positions=64", "model.vocab_size=1024"]
REDUCED = Sizes(
    presets={"tiny": TINY}, micro_batch={"tiny": 2}, micro_batches=2, seq_len=32,
    compiles=(False,), bench_steps=2, bench_warmup=1, launch_skip=1, launch_steps=2,
    preset_dropout=["model.resid_pdrop=0.1", "model.embd_pdrop=0.1", "model.attn_pdrop=0.1"],
    big="tiny", small="tiny",
    offload=["--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--micro-batches",
             "1", "--steps", "2", "--warmup", "1", "--adam-params", "80000",
             "--variants", "1"],
    calibrate=[*TINY, "train.seq_len=32", "train.micro_batch_size=2"],
    document_mask=["--preset", "llama-tiny", "--seq-len", "64", "--micro-batch", "2",
                   "--document-tokens", "16", "64", "--steps", "1", "--warmup", "1",
                   "--device", "cpu"],
    limits={"cuda-tests": 120, "document-mask": 60, "bench": 60, "bench-compiled": 60, "launch": 90,
            "launch-compiled": 90, "offload": 90, "calibrate": 90, "checkpoint": 90,
            "rerun": 90, "prepare": 120},
    device=["device=cpu", "log.peak_tflops=1"])  # MFU against a nominal 1 TFLOP/s on CPU
