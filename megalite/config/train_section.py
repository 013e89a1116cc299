"""The `train` section of the schema: the steps, the batch, the sequence, recomputation, the
attention kernel and mask, and when a run stops; its own checks (`TrainConfig.check`). The
rules it shares with other sections or the world size are the layout's (grid_rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megalite.config.document_kernel import check_document_kernel
from megalite.config.errors import fail

# SDPA kernels `train.attention` may name (megalite.model.attention); the last two need CUDA.
ATTENTION_CHOICES = ("auto", "flash", "cudnn", "efficient", "math")
ATTENTION_CUDA_ONLY = ("cudnn", "efficient")
# `train.attention_mask`: causal over the whole window, or within each document (EOS-separated)
ATTENTION_MASKS = ("causal", "document")
# SDPA kernels that take no arbitrary mask (flash: causal or none; cudnn: as megalite calls it)
ATTENTION_WITHOUT_MASK = ("flash", "cudnn")
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@dataclass
class TrainConfig:
    max_steps: int = 300  # optimizer steps
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    global_batch_size: int = 32  # sequences per optimizer step over all DP ranks
    rampup_batch_size: Optional[List[int]] = None  # [start, increment, samples]: the global
    #   batch grows from `start` by `increment` in equal steps over the first `samples`
    #   samples to global_batch_size (Megatron's --rampup-batch-size); None = constant
    seq_len: int = 128
    eval_every: int = 100  # steps between validation passes (0 = never)
    eval_steps: int = 10  # global batches per validation pass (the same windows in any layout)
    recompute: bool = False  # recompute each block's activations in backward (saves memory)
    recompute_layers: Optional[int] = None  # with recompute: only the first N blocks of each
    #                                         pipeline stage (of each model chunk with virtual
    #                                         stages; Megatron's --recompute-method block
    #                                         --recompute-num-layers N); None = every block
    compile: bool = False  # torch.compile each transformer block (CUDA: fused kernels)
    attention: str = "auto"  # SDPA kernel: auto | flash | cudnn | efficient | math
    attention_mask: str = "causal"  # causal (every earlier token of the window) | document
    #   (only earlier tokens of the same document, documents ended by EOS; Llama 3's)
    document_kernel: str = "auto"  # the document mask's kernel: auto | flex | varlen | sdpa
    #   (megalite.config.document_kernel; auto: flex on CUDA without dropout, else sdpa)
    reset_positions: bool = False  # positions restart at 0 after each EOS (GPT-2's learned
    #   positions, Llama's RoPE; Megatron's --reset-position-ids)
    eos_loss: bool = True  # false: the target after an EOS (the next document's first token)
    #   does not count in the loss (Megatron's --eod-mask-loss)
    max_bad_steps: int = 5  # consecutive steps with a NaN/inf loss or gradient that are
    #                         skipped (no update, counted) before the run stops
    max_minutes: Optional[float] = None  # stop after this much training time with a
    #                                      checkpoint (below the scheduler's time limit)
    exit_signal: Optional[str] = None  # SIGTERM | SIGUSR1 | SIGUSR2 | SIGINT: on this signal
    #                                    finish the step, checkpoint and exit cleanly
    gc_every: Optional[int] = None  # Python's garbage collector off while training, run on
    #                                 every rank after every N-th step; None = automatic

    def check(self) -> None:
        if self.seq_len < 1:
            fail("train.seq_len", self.seq_len, "must be a positive integer (and at most "
                  "model.n_positions)")
        if self.micro_batch_size < 1:
            fail("train.micro_batch_size", self.micro_batch_size, "must be a positive integer")
        if self.global_batch_size < 1:
            fail("train.global_batch_size", self.global_batch_size, "must be a positive "
                  "multiple of micro_batch_size*dp (m = global_batch_size / (micro_batch_size*dp)"
                  " micro-batches per step must be >= 1)")
        self._check_rampup()
        if self.attention not in ATTENTION_CHOICES:
            fail("train.attention", self.attention, f"use one of {', '.join(ATTENTION_CHOICES)}")
        self._check_documents()
        if self.recompute_layers is not None and (self.recompute_layers < 1 or not self.recompute):
            fail("train.recompute_layers", self.recompute_layers,
                  "needs train.recompute=true and a value >= 1 (the blocks recomputed at the "
                  "start of each pipeline stage), or null for every block")
        self._check_stopping()
        if self.eval_every < 0 or self.eval_steps < 1:
            fail("train.eval_every/eval_steps", (self.eval_every, self.eval_steps),
                  "eval_every must be >= 0 (0 = never) and eval_steps >= 1")

    def _check_documents(self) -> None:
        if self.attention_mask not in ATTENTION_MASKS:
            fail("train.attention_mask", self.attention_mask,
                  f"use one of {', '.join(ATTENTION_MASKS)}")
        for key in ("reset_positions", "eos_loss"):
            if not isinstance(getattr(self, key), bool):
                fail(f"train.{key}", getattr(self, key), "must be true or false")
        if self.attention_mask == "document" and self.attention in ATTENTION_WITHOUT_MASK:
            fail("train.attention", self.attention,
                  "this SDPA kernel takes no document mask (train.attention_mask=document); "
                  "use auto (FlexAttention on CUDA, SDPA with a boolean mask on CPU), efficient "
                  "or math (SDPA with a boolean mask), or train.attention_mask=causal")
        check_document_kernel(self.document_kernel, self.attention_mask, self.attention)

    @property
    def uses_documents(self) -> bool:
        """Whether a batch carries its documents (boundaries found from EOS)."""
        return self.attention_mask == "document" or self.reset_positions or not self.eos_loss

    def _check_stopping(self) -> None:
        if self.max_steps < 1:
            fail("train.max_steps", self.max_steps, "must be a positive integer")
        if self.max_minutes is not None and self.max_minutes <= 0:
            fail("train.max_minutes", self.max_minutes, "must be > 0 minutes, or null (no limit)")
        if self.exit_signal is not None and self.exit_signal not in EXIT_SIGNALS:
            fail("train.exit_signal", self.exit_signal,
                  f"use one of {', '.join(EXIT_SIGNALS)}, or null (no handler)")
        if self.gc_every is not None and self.gc_every < 1:
            fail("train.gc_every", self.gc_every, "must be >= 1 (steps between collections, e.g. "
                  "50), or null for Python's automatic collection")
        if self.max_bad_steps < 1:
            fail("train.max_bad_steps", self.max_bad_steps, "must be >= 1 (1 = stop at the "
                  "first non-finite step)")

    def _check_rampup(self) -> None:
        """The ramp's shape; whole micro-batches per DP rank is a layout rule."""
        if self.rampup_batch_size is None:
            return
        ramp = list(self.rampup_batch_size)
        example = "e.g. train.rampup_batch_size=[32,32,100000]"
        if len(ramp) != 3 or min(ramp) < 1:
            fail("train.rampup_batch_size", ramp, f"three positive integers [start, "
                  f"increment, samples], {example}")
        start, increment, _ = ramp
        if start >= self.global_batch_size or (self.global_batch_size - start) % increment:
            fail("train.rampup_batch_size", ramp, f"start must be below "
                  f"train.global_batch_size={self.global_batch_size} and reach it in whole "
                  f"increments (global_batch_size - start a multiple of increment); {example}")
