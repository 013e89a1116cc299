"""The plan's offload terms (`megalite.plan.memory._stage_plan` applies them to each stage): what
`offload.optimizer = f` moves from the device to host memory, and the PCIe bytes per step of
both offloads — the numbers `megalite.parallel.offload` and `megalite.model.activation_offload`
hold and copy — and the time model's two offload terms (`megalite.plan.time_model`): what
activation offload's copies add to a chunk's forward and backward, its schedule simulated
(`activation_copies_exposed`), and what offload.optimizer's copies and host passes add
(`optimizer_offload_s`), both at a device profile's rates.

With Ψ_o = the elements of the rank's owned optimizer range (Ψ/N where ZeRO shards the
optimizer, else Ψ), n = f·Ψ_o offloaded elements and e the compute dtype's bytes:

  device   O: (8 + 4 if e < 4)·(Ψ_o − n)   (moments, fp32 master where e < 4)
           G: zero 2/3 keep 4·(Ψ_o − n) (their sharded gradient); zero 0/1 unchanged (the
              whole fp32 gradient is accumulated on the device either way)
  host     master 4n + moments 8n + gradient 4n (+ zero 2/3's copy staging 4n)
           (+ the model-dtype cast buffer e·n where e < 4)
  PCIe     device -> host: 4n per reduction (zero 0/1: once per step, zero 2/3: m times);
           host -> device: e·n (the updated parameters);
           activation offload: the offloaded layers' saved tensors, out and back, m times
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Sequence, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import Config
from megalite.model.activation_offload import IN_TRANSIT
from megalite.plan.devices import DeviceProfile
from megalite.plan.dims import layer_activation_bytes, offloaded_layers, recomputed_layers

# Host bytes a parameter of offload.optimizer's passes move (`optimizer_offload_s`): the
# norm's squares (read the gradient), zero 2/3's fold (read the staging, read and write the
# gradient), the fused AdamW (read parameter, gradient and both moments, write parameter and
# moments: what the measured host AdamW rate moves); the cast reads 4 and writes e.
HOST_NORM_BYTES = 4
HOST_FOLD_BYTES = 12
HOST_ADAM_BYTES = 28


def owned_elements(layout: Layout, psi: float, expert_psi: float = 0.0) -> float:
    """Ψ_o: the elements whose optimizer state one rank holds (ZeRO shards over DP x CP; of
    the `expert_psi` EP-split experts among `psi`, over EDP)."""
    if not layout.shards_optimizer:
        return psi
    return (psi - expert_psi) / layout.grad_replicas + expert_psi / layout.expert_grad_replicas


def apply_offload(f: float, layout: Layout, psi: float, e: int, micro: int,
                  state: Dict[str, float], host: Dict[str, float],
                  activations_per_micro: float, expert_psi: float = 0.0) -> Dict[str, float]:
    """Move the share `f` (offload.optimizer) of `state` (device bytes by kind) into `host`,
    and return the PCIe bytes per step by direction. `activations_per_micro`: the host bytes
    one micro-batch's offloaded activations take (over the stage's chunks); `expert_psi`:
    the EP-split experts among `psi`."""
    n = f * owned_elements(layout, psi, expert_psi)
    sharded_grads = layout.shards_gradients
    state["optimizer"] *= 1 - f
    if sharded_grads:
        state["grads"] *= 1 - f
    if n:
        host["optimizer"] = (16 + (4 if sharded_grads else 0) + (e if e < 4 else 0)) * n
    reductions = micro if sharded_grads else 1
    return {"d2h": 4 * n * reductions + micro * activations_per_micro,
            "h2d": e * n + micro * activations_per_micro}


def optimizer_placement(f: float, base: str) -> str:
    """The O placement with the share `f` offloaded (offload.optimizer; `base`: replicated
    or sharded over DP)."""
    if not f:
        return base
    master = "fp32 master weights and moments"
    share = "all" if f == 1 else f"{f:.0%} of the owned range"
    return f"{base}, offloaded ({share}: {master}) to host memory"


ROUNDING = 1e-12  # relative: a difference of sums of float times below it is rounding


def activation_copies_exposed(offloaded: Sequence[bool], forward_s: float, backward_s: float,
                              after_s: float, out_s: float, in_s: float,
                              in_transit: int = IN_TRANSIT) -> float:
    """Seconds one micro-batch's forward + backward of a chunk's blocks lasts beyond its
    compute when `offloaded[i]` says block i's activations go to the host: the schedule
    `megalite.model.activation_offload` runs, on one compute stream and two copy streams
    (out, back), simulated. Each block's forward takes `forward_s`, its backward `backward_s`;
    `after_s`: the chunk's compute between its last block's forward and that block's backward
    (the head and the loss); a block's copies take `out_s` out and `in_s` back.

    Forward: block j starts once at most in_transit − 1 + (the kept blocks from j on) of the
    offloaded blocks' copies out are unfinished; an offloaded block's copy out starts after
    its forward and the copy before it. Backward, at block j (every block after it done):
    offloaded blocks up to j not yet back are restored, last first, while fewer than
    in_transit + (the kept blocks after j) are in transit (copies out unfinished + restored
    blocks not yet passed) — each restore starting once the compute stream is there, the
    block's copy out is done and the restore before it is; block j's own restore happens
    regardless; its backward starts when its restore is done."""
    n = len(offloaded)
    kept_from = [0] * (n + 1)
    for i in reversed(range(n)):
        kept_from[i] = kept_from[i + 1] + (not offloaded[i])
    t, out_end, ends, copy_free = 0.0, {}, [], 0.0  # ends: the copies out's, ascending
    for j in range(n):
        first = bisect.bisect_right(ends, t)  # ends[first:] still running
        allowed = in_transit - 1 + kept_from[j]
        if len(ends) - first > allowed:
            t = ends[len(ends) - allowed - 1]  # the CPU waited for the oldest
        t += forward_s
        if offloaded[j]:
            copy_free = max(t, copy_free) + out_s
            out_end[j] = copy_free
            ends.append(copy_free)
    t += after_s
    back: Dict[int, float] = {}  # block -> its restore's end
    live: set = set()
    restore_free = 0.0

    def restore(i: int, now: float) -> None:
        nonlocal restore_free
        restore_free = max(now, restore_free, out_end[i]) + in_s
        back[i] = restore_free
        live.add(i)

    for j in reversed(range(n)):
        live -= {i for i in live if i > j}
        room = in_transit + kept_from[j + 1] - len(live) \
            - (len(ends) - bisect.bisect_right(ends, t))
        for i in reversed(range(j + 1)):
            if offloaded[i] and i not in back:
                if room <= 0 and i != j:
                    break
                restore(i, t)
                room -= 1
        if offloaded[j]:
            t = max(t, back[j])
        t += backward_s
    compute = n * (forward_s + backward_s) + after_s
    exposed = t - compute  # t sums the same times in another order: rounding is not time
    return exposed if exposed > ROUNDING * compute else 0.0


def optimizer_offload_s(n: float, m: int, sharded_grads: bool, e: int, t_f: float,
                        t_b: float, d2h_gbps: float, h2d_gbps: float, host_rate: float,
                        last_elements: float, window: bool) -> Dict[str, float]:
    """Seconds per step offload.optimizer adds, by part, as `megalite.parallel.offload` runs it
    (`n` offloaded elements of one rank; `host_rate`: the host AdamW's parameters a second
    for this rank; the host's other passes at the memory rate AdamW reached,
    HOST_ADAM_BYTES a parameter; `t_f`, `t_b`: one micro-batch's forward and backward):

      gradients  each bucket's copy (4 bytes an element at d2h) issued as its reduction is
                 launched and the worker's passes over it (zero 0/1: the norm's squares, 4;
                 zero 2/3: each micro-batch's fold, 12) under that micro-batch's backward:
                 what exceeds it, + the last bucket's copy and squares, which come after the
                 backward (`last_elements`: the last gradient to complete, the tied
                 embedding's on the first stage); zero 2/3 square after the last fold
      step       the host AdamW (28) and the cast to the model dtype (4 + e) range by range,
                 each range's copy back (e at h2d) under the next range's update: the longer
                 of the two, less the next forward's first micro-batch, which waits for each
                 block's own range (`window`; none where zero 1/2 gather the parameters in
                 the step)"""
    per_byte = 1.0 / (HOST_ADAM_BYTES * host_rate)  # host seconds a byte
    d2h, h2d = d2h_gbps * 1e9, h2d_gbps * 1e9
    squares = HOST_NORM_BYTES * n * per_byte
    if sharded_grads:
        fold = HOST_FOLD_BYTES * n * per_byte
        gradients = m * max(0.0, max(4 * n / d2h, fold) - t_b) + squares
    else:
        gradients = max(0.0, max(4 * n / d2h, squares) - t_b)
    last = min(n, last_elements)
    gradients += 4 * last / d2h + HOST_NORM_BYTES * last * per_byte
    update = (HOST_ADAM_BYTES + 4 + e) * n * per_byte
    step = max(0.0, max(update, e * n / h2d) - (t_f if window else 0.0))
    return {"gradients": gradients, "step": step}


def activation_offload_s(cfg: Config, lay: Layout, profile: DeviceProfile, k: int,
                          chunks: List[range], e: int, block: Tuple[float, float],
                          after_last: float) -> float:
    """What activation offload's copies add to one micro-batch of stage k: the runtime's
    schedule simulated per chunk (`activation_copies_exposed`); `block`, a block's (forward,
    backward) seconds; `after_last`, the compute between the forward of the model's last
    block and its backward (head and loss, on the chunk that holds them)."""
    act = layer_activation_bytes(cfg, lay, e)  # the memory plan's host bytes
    out, back = act / (profile.d2h_gbps * 1e9), act / (profile.h2d_gbps * 1e9)
    exposed = 0.0
    for c, chunk in enumerate(chunks):
        n = len(chunk)
        off = offloaded_layers(cfg, n)
        # the recomputed blocks first, then the offloaded, then the kept
        flags = [True] * off + [False] * (n - recomputed_layers(cfg, n) - off)
        after = after_last if lay.placement.holds_last(k, c) else 0.0
        exposed += activation_copies_exposed(flags, *block, after, out, back)
    return exposed


def optimizer_offload_term(cfg: Config, lay: Layout, profile: DeviceProfile, host: float,
                            host_rate: float, m: int, e: int, t_f: float, t_b: float,
                            first: bool) -> float:
    """offload.optimizer's term for a stage with `host` offloaded elements
    (`optimizer_offload_s`): the last bucket reduced is the tied embedding's on the first
    stage, a full bucket elsewhere; the host step hides under the next forward unless zero
    1/2 gather the parameters in the step."""
    last = (cfg.model.vocab_size * cfg.model.n_embd / lay.tp_size if first
            else cfg.parallel.bucket_mb * 2**20 / 4) * cfg.offload.optimizer
    window = not (lay.shards_optimizer and not lay.shards_parameters
                  and not cfg.parallel.overlap_param_gather)
    parts = optimizer_offload_s(host, m, lay.shards_gradients, e, t_f, t_b, profile.d2h_gbps,
                                profile.h2d_gbps, host_rate, last, window)
    return parts["gradients"] + parts["step"]
