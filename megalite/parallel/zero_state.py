"""The ZeRO engine's state as others read it: the checkpoint pieces (what
`megalite.checkpoint` saves and restores: this rank's owned fp32 master ranges and AdamW
moments, by parameter range, wherever they live — device or, with offload.optimizer, host) and
the bytes it holds (what `megalite.plan.memory` predicts). A mixin of `megalite.parallel.zero
.ZeroEngine`, whose attributes it reads: `main_params`, `buckets`, `optimizer(s)`,
`_optimizer_of`, `layout`, `offload`."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

from megalite.parallel.bucket import MOMENTS, StatePiece


class EngineState:
    def adam_state(self, piece: nn.Parameter) -> dict:
        """AdamW's state of one master piece (empty before the first step)."""
        return self._optimizer_of[id(piece)].state.get(piece, {})

    # --- checkpoint pieces (what `megalite.checkpoint` reads and restores) -----------------

    def adam_step(self) -> int:
        """Optimizer steps taken (AdamW's bias-correction count, the same for every piece)."""
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                return int(state["step"])
        return 0

    def state_pieces(self) -> List[StatePiece]:
        """This rank's owned state, one piece per owned range of a parameter: the fp32 master
        weights ("param") and AdamW's moments ("exp_avg", "exp_avg_sq", once they exist).
        An EP-split expert weight's range is given in the whole [E, ...] tensor (its EP rank's
        experts are a contiguous run of it, `ParamSpec.expert_offset`), so any ep reads it."""
        pieces = []
        for index, (piece, seg, bucket) in enumerate(self.main_params):
            state = self.adam_state(piece)
            tensors = {"param": piece, **{k: state[k] for k in MOMENTS if k in state}}
            s_lo, s_hi = bucket.dp_share
            a, b = max(seg.flat_lo, s_lo), min(seg.flat_hi, s_hi)
            at = seg.param_lo - seg.flat_lo + (seg.spec.expert_offset(
                self.topo.ep_rank, self.topo.ep_size) if bucket.expert else 0)
            pieces.append(StatePiece(seg.spec, seg.flat_lo + at, seg.flat_hi + at, tensors,
                                     index, (a + at, max(a, b) + at)))
        return pieces

    @torch.no_grad()
    def load_state_piece(self, piece: StatePiece, kind: str, values: torch.Tensor,
                         adam_step: int) -> None:
        """Restore one kind of one piece (`params_from_master` then updates the model)."""
        param = self.main_params[piece.index][0]
        if self.offload is not None:
            self.offload.copies_done()  # no copy to the device still reads a host master
        if kind == "param":
            param.copy_(values)
            return
        optimizer = self._optimizer_of[id(param)]
        state = optimizer.state[param]
        if "step" not in state:
            fused = bool(optimizer.defaults.get("fused"))
            state["step"] = torch.tensor(float(adam_step), dtype=torch.float32,
                                         device=param.device if fused else "cpu")
            for moment in MOMENTS:
                state[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state[kind].copy_(values)

    @torch.no_grad()
    def params_from_master(self) -> None:
        """Model parameters from the (just loaded) master ranges."""
        self.wait_for_params()
        if self.offload is not None:
            self.offload.params_to_device()
            self.offload.params_needed(self.buckets)  # the gathers below read the copies
        for b in self.buckets:
            b.after_step()

    # --- accounting ---------------------------------------------------------------------

    def state_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for parameters (model dtype; stage 3: its range only),
        gradients (fp32 accumulation buffers) and optimizer state (Adam moments, plus the fp32
        master copy where the model is not fp32), also before the first step allocates the
        moments."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        params = grads = optim = 0
        for b in self.buckets:
            params += nbytes(b.param_region if self.layout.shards_parameters else b.param_full)
            grads += nbytes(b.grad_full if b.grad_full is not None else b.main_grad)
            if b.main is not b.param_region:
                optim += nbytes(b.main)
        for piece, _, _ in self.main_params:
            if self._optimizer_of[id(piece)] is not self.optimizer:
                continue  # offloaded: `host_state_bytes`
            state = self.adam_state(piece)
            moments = [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
            # AdamW creates its moments at the first step: count them before that too
            optim += sum(nbytes(v) for v in moments) if moments else 2 * nbytes(piece)
        return {"params": params, "grads": grads, "optimizer": optim}

    def host_state_bytes(self) -> int:
        """Host bytes of the offloaded optimizer state (0 without offload.optimizer)."""
        return 0 if self.offload is None else self.offload.host_bytes()
