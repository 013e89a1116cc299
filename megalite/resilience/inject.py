"""Fault drills (`resilience.inject`, parsed by `megalite.config.inject`): one rank's
device computes wrong at one step, as a faulty GPU would, so that a run's attribution of the
step (`resilience.rerun`) can be exercised end to end — on a cluster before trusting it, or in
tests. Refused unless `resilience.allow_inject=true`.

The trainer runs every execution of a step inside `FaultInjector.around(step, execution)`
(execution 0 is the step's first; later ones are re-executions and recomputations of another
replica's micro-batches). When the drill is armed for that execution on this rank:

    target=param  one bit of this rank's copy of the parameter is flipped for the execution
                  (forward and backward read it) and flipped back after it
    target=grad   one bit of this rank's local gradient of the parameter is flipped where the
                  gradient enters the data-parallel reduction (the first time in the execution)

A transient drill arms the step's first execution only; a persistent one every execution of
the step on this rank.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from megalite.config.inject import KEY, InjectSpec
from megalite.utils.log import get_logger

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` of a contiguous tensor, in place."""
    width = 8 * tensor.element_size()
    mask = 1 << bit
    if mask >= 1 << (width - 1):  # the sign bit, as the signed integer type holds it
        mask -= 1 << width
    element = tensor.view(-1)[index:index + 1].view(_INT_OF_SIZE[tensor.element_size()])
    element.bitwise_xor_(mask)


class FaultInjector:
    """The drill of one rank (inert on every rank but the spec's)."""

    def __init__(self, spec: InjectSpec, model, engine, rank: int):
        self.spec, self.engine = spec, engine
        self.here = rank == spec.rank
        self.bit = spec.bit
        self.param: Optional[torch.nn.Parameter] = None
        self.injected = 0  # executions corrupted so far
        self._grad_armed = False
        if not self.here:
            return
        self.param = _find(model, spec.tensor, rank)
        width = 8 * (self.param.element_size() if spec.target == "param" else 4)  # fp32 grads
        self.bit = spec.bit_in(width)
        if spec.index >= self.param.numel() or self.bit >= width:  # checked before launch
            raise ValueError(f"{KEY}: rank {rank}'s {spec.tensor} has {self.param.numel()} "
                             f"elements of {width} bits; index={spec.index}, bit={self.bit} "
                             "is outside it")
        if spec.target == "grad":  # ahead of any other listener: they see the flipped value
            engine.grad_launching.insert(0, self._flip_grad)

    def armed(self, step: int, execution: int) -> bool:
        return self.here and step == self.spec.step and (
            self.spec.kind == "persistent" or execution == 0)

    @contextlib.contextmanager
    def around(self, step: int, execution: int) -> Iterator[None]:
        """Run one execution of `step`, corrupted when the drill is armed for it."""
        if not self.armed(step, execution):
            yield
            return
        spec = self.spec
        get_logger().warning(f"{KEY}: flipping bit {self.bit} of {spec.tensor}"
                             f"[{spec.index}]'s {spec.target} on rank {spec.rank} at step "
                             f"{step} (execution {execution}, {spec.kind})")
        self.injected += 1
        try:
            if spec.target == "param":
                # parallel.overlap_param_gather: the step's parameter gather may still be
                # writing the copy; it would overwrite (or race) the flip
                self.engine.wait_for_params()
                with torch.no_grad():
                    flip_bit(self.param.data, spec.index, self.bit)
            else:
                self._grad_armed = True
            yield
        finally:
            self._grad_armed = False
            if spec.target == "param":
                with torch.no_grad():
                    flip_bit(self.param.data, spec.index, self.bit)  # as it was

    def _flip_grad(self, bucket, grad: torch.Tensor) -> None:
        """The engine's grad_launching listener: `grad` is `bucket`'s full local gradient,
        about to be reduced."""
        if not self._grad_armed:
            return
        for i, p in enumerate(bucket.params):
            if p is self.param:
                flip_bit(grad, bucket.flat.offsets[i] + self.spec.index, self.bit)
                self._grad_armed = False
                return


def _find(model, name: str, rank: int) -> torch.nn.Parameter:
    """This rank's copy of the parameter called `name` (the first copy of a tied one)."""
    for local, p in model.named_parameters():
        spec = model.param_specs[local]
        if spec.name == name and not spec.tied_copy:
            return p
    raise ValueError(f"{KEY}: rank {rank} holds no parameter {name} (its pipeline stage has "
                     "other blocks); name one of its parameters, e.g. "
                     f"{next(iter(model.param_specs.values())).name}")
