"""The model presets (megalite/conf/model/*.yaml) read as data, for messages that name the
ones that would work (`longer_context`)."""
from __future__ import annotations

from typing import Dict, List

from omegaconf import OmegaConf

from megalite.config.model import ModelConfig
from megalite.config.schema import CONF_DIR

SHAPE = ("n_layer", "n_embd", "n_head", "n_kv_head", "n_inner", "vocab_size")


def model_presets() -> Dict[str, dict]:
    """Each model preset's keys by its name (model=<name>)."""
    return {p.stem: OmegaConf.to_container(OmegaConf.load(p))
            for p in sorted((CONF_DIR / "model").glob("*.yaml"))}


def longer_context(m: ModelConfig, seq_len: int) -> str:
    """The presets of `m`'s family with at least `seq_len` positions, those of `m`'s shape
    first (named as such), as a clause of a message; '' where there are none."""
    fits = {name: p for name, p in model_presets().items()
            if p.get("arch") == m.arch and p.get("n_positions", 0) >= seq_len}
    if not fits:
        return ""
    same = [n for n, p in fits.items() if all(p.get(k) == getattr(m, k) for k in SHAPE)]
    named: List[str] = [f"{n} (this shape, {fits[n]['n_positions']:,} positions)" for n in same]
    others = sorted((n for n in fits if n not in same),
                    key=lambda n: fits[n]["n_layer"] * fits[n]["n_embd"])  # smallest first
    named += [f"{n} ({fits[n]['n_positions']:,})" for n in others]
    return f"; the {m.arch} presets with that context: model={', '.join(named)}"
