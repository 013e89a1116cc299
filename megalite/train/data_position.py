"""What a resumed run says when its data position means something else than it did in the
checkpointed run (another seq_len, seed or data)."""
from __future__ import annotations

from typing import List

from megalite.config.schema import Config


def data_position_warnings(meta: dict, cfg: Config) -> List[str]:
    """The sampler's position is a count of samples (windows of train.seq_len + 1 tokens in a
    sample order seeded by `seed`, over `data.dir` or the `data.blend`): resumed under another
    seq_len, seed or data it points elsewhere in the data. Legal (e.g. a longer context late in
    training), but worth saying."""
    then = {"train.seq_len": meta["config"]["train"]["seq_len"], "seed": meta["config"]["seed"],
            "data": _data_label(meta["data_sources"])}
    now = {"train.seq_len": cfg.train.seq_len, "seed": cfg.seed,
           "data": _data_label([[str(d), w] for d, w in cfg.data.sources()])}
    return [f"{key}={now[key]!r} differs from the checkpoint's {then[key]!r}: the resumed run "
            f"continues at sample {meta['consumed_samples']} of a different order of windows, "
            "not where the checkpointed run stopped"
            for key in then if then[key] != now[key]]


def _data_label(sources: List[list]):
    """A data directory alone by its path, a blend as its [weight, dir] list."""
    if len(sources) == 1:
        return sources[0][0]
    return [x for d, w in sources for x in (w, d)]
