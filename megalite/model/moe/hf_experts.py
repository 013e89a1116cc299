"""The per-expert layout of a transformers MoE checkpoint (one tensor per expert and weight,
e.g. Mixtral's `block_sparse_moe.experts.N.w1`, Qwen3-MoE's `mlp.experts.N.gate_proj`) read
into transformers 5's fused layout, megalite's: `mlp.experts.gate_up_proj` [E, 2I, h] =
[gate | up] per expert, `mlp.experts.down_proj` [E, h, I]. A family gives its pattern and
names; the stacking is this one function."""
from __future__ import annotations

import re
from typing import Callable, Dict, Tuple

import torch


def stack_per_expert(hf_sd: Dict[str, torch.Tensor], pattern: re.Pattern,
                     names: Tuple[str, str, str],
                     rename: Callable[[str], str] = lambda name: name
                     ) -> Dict[str, torch.Tensor]:
    """`hf_sd` with every per-expert weight matched by `pattern` (groups: the block's prefix,
    the expert index, the weight's name) stacked; `names`: the (gate, up, down) weights'
    names; `rename`: the other tensors' names (a family's old module name). Raises
    ValueError where a block's experts do not cover 0..E-1 for every weight."""
    gate, up, down = names
    experts: Dict[str, Dict[str, Dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in hf_sd.items():
        m = pattern.match(name)
        if m is None:
            out[rename(name)] = t
            continue
        experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, ws in experts.items():
        n = len(ws.get(gate, {}))
        if any(sorted(ws.get(w, {})) != list(range(n)) for w in names):
            raise ValueError(f"{prefix}: the per-expert weights do not cover experts 0..{n - 1}")
        out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ws[gate][e], ws[up][e]], dim=0) for e in range(n)])
        out[prefix + ".mlp.experts.down_proj"] = torch.stack([ws[down][e] for e in range(n)])
    return out
