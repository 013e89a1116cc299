"""The offload benchmark's variants (`megalite_bench.offload`): their names, `--variants`
parsed, the planner's activation offload at the bench's shapes, and the order they are built
and timed in (one alive at a time, the baseline between them)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from megalite.config.layout import Layout
from megalite.config.schema import load_config

FRACTIONS = (0.0, 0.5, 1.0)
Variant = Tuple[str, Optional[float], bool, Optional[int]]  # (name, optimizer fraction or
#                                             None: torchao, activations, their first K blocks)


def variant_name(fraction: float, activations: bool, layers: Optional[int] = None) -> str:
    return f"optimizer={fraction:g}" + (" activations" if activations else "") + (
        f"(first {layers})" if activations and layers is not None else "")


def parse_variants(texts: Optional[List[str]], cuda: bool
                   ) -> List[Tuple[float, bool, Optional[int]]]:
    """(fraction, activations, first K blocks or None: all) of `--variants` (F, F:act or
    F:act:K), or the default sweep."""
    if not texts:
        return [(f, a, None) for a in ((False, True) if cuda else (False,)) for f in FRACTIONS]
    out = []
    for text in texts:
        fraction, _, act = text.partition(":")
        act, _, layers = act.partition(":")
        ok = act in ("", "act") and (not layers or (act and layers.isdigit() and int(layers)))
        if not ok or not 0 <= float(fraction) <= 1:
            raise SystemExit(f"--variants {text!r}: F, F:act or F:act:K with F in [0, 1], K "
                             "a positive number of blocks")
        out.append((float(fraction), act == "act", int(layers) if layers else None))
    return out


def planned_activation_layers(preset_overrides: List[str], seq: int, micro_batch: int, m: int,
                              gib: float) -> Optional[int]:
    """The planner's activation offload for one GPU of `gib` GiB at this bench's shapes (bf16,
    dropout 0, zero 0): the fewest first blocks under which the plan fits
    (`megalite.plan.fit.fewest_offloaded_blocks`; None: every block, or nothing fits —
    SystemExit)."""
    from megalite.plan.fit import fewest_offloaded_blocks

    cfg = load_config(preset_overrides + [
        "model.resid_pdrop=0", "model.embd_pdrop=0", "model.attn_pdrop=0",
        f"train.seq_len={seq}", f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={micro_batch * m}"])
    layout = Layout.from_config(cfg, 1, "cuda", True)
    found = fewest_offloaded_blocks(cfg, layout,
                                    lambda p: p.peak.bytes["total"] <= gib * 2**30)
    if found is None:
        raise SystemExit(f"--act-fit-gib {gib:g}: no activation offload fits the plan")
    return found[0].offload.activations_layers


def build_order(variants: List[Tuple[float, bool, Optional[int]]], baseline_every: int
                ) -> List[Variant]:
    """The order variants are built and timed in, one alive at a time: the no-offload
    baseline first, again after every `baseline_every` others, and last."""
    base: Variant = (variant_name(0.0, False), 0.0, False, None)
    others = [(variant_name(f, a, k), f, a, k) for f, a, k in variants
              if (f, a) != (0.0, False)]
    order, since = [base], 0
    for v in others:
        if since == max(1, baseline_every):
            order.append(base)
            since = 0
        order.append(v)
        since += 1
    return order + [base]
