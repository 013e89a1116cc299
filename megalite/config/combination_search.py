"""The search over `megalite.config.combinations`' axes: which combinations of their values
validation refuses (of 2 to t axis values, each value beside each extra setting, two extra
settings together, and the settings beside expert parallelism) and the rows the combination
matrix runs (`matrix_rows`: the covering array under those refusals). Every verdict is
`combinations.refusal`'s: validation's, on a run made of the values.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

from megalite.config.combinations import (
    AXES,
    EP_SETTINGS,
    MIXTRAL,
    OTHER_SETTINGS,
    REGRESSIONS,
    TIGHT,
    Refusal,
    Row,
    allowed_rows,
    refusal,
    row_config,
    row_of,
    world_size,
)
from megalite.config.covering import combinations_of, covering_array, find_row
from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import Config


def ep_refusals(base: Config) -> List[Tuple[str, Optional[Refusal]]]:
    """(name, validation's refusal or None) of each of EP_SETTINGS beside MoE at ep 2 over
    dp 2 (the world grown by the setting's tp, cp and pp)."""
    out = []
    for name, extra in EP_SETTINGS:
        settings = {**MIXTRAL, "ep": 2, **extra}
        world = 2 * settings.get("tp", 1) * settings.get("cp", 1) * settings.get("pp", 1)
        try:
            validate(row_config(base, row_of({}), settings), world)
            out.append((name, None))
        except ConfigError as e:
            out.append((name, Refusal("megalite", e.key or str(e).split("=")[0], str(e))))
    return out


def refused_tuples(base: Config, strength: int) -> List[Tuple[Dict[str, str], Refusal]]:
    """Every combination of 2 to `strength` axis values that no run of the matrix can hold,
    with its refusal; combinations that contain a smaller refused one are left out (implied).

    A combination is refused when no row holding it passes: neither a row near the
    all-first-values one (`find_row`) nor the row where each of its values runs alone (the
    settings each value needs by itself, e.g. pp=2 for zb-h1, with the combination's values
    on top), whose refusal is the one reported."""
    allowed, sizes = allowed_rows(base), [len(a.values) for a in AXES]
    default, out, refused = row_of({}), [], set()
    for t in range(2, strength + 1):
        for axes in itertools.combinations(range(len(AXES)), t):
            for values in itertools.product(*(range(sizes[a]) for a in axes)):
                pairs = tuple(zip(axes, values))
                if any(sub in refused for k in range(2, t)
                       for sub in itertools.combinations(pairs, k)):
                    continue
                if find_row(dict(pairs), sizes, allowed, default) is not None:
                    continue
                why = refusal(base, _where_each_runs(pairs, sizes, allowed, default))
                if why is not None:
                    refused.add(pairs)
                    out.append(({AXES[a].name: AXES[a].values[v].label for a, v in pairs}, why))
    return out


def refused_settings(base: Config) -> List[Tuple[Dict[str, str], str, Refusal]]:
    """(axis value, the name of a setting of OTHER_SETTINGS, the refusal) for each setting
    validation refuses beside that value, in the run where the value runs alone (`find_row`
    near the all-first-values run), although that run and the setting alone both run."""
    allowed, sizes = allowed_rows(base), [len(a.values) for a in AXES]
    default, out = row_of({}), []
    for name, extra in OTHER_SETTINGS:
        if refusal(base, default, extra) is not None:  # refused whatever the axes
            continue
        for a, axis in enumerate(AXES):
            for v in range(1, len(axis.values)):
                row = find_row({a: v}, sizes, allowed, default)
                why = None if row is None else refusal(base, row, extra)
                if why is not None and not _refused_by_companion(base, row, a, extra, sizes,
                                                                 allowed, default):
                    out.append(({axis.name: axis.values[v].label}, name, why))
    return out


def _refused_by_companion(base, row, a, extra, sizes, allowed, default) -> bool:
    """Whether another value the run of axis `a`'s value needs (ep 2 runs with an MoE family
    and a second rank, e.g. cp 2) refuses the setting `extra` in its own run: the refusal is
    that value's, listed there."""
    return any(refusal(base, companion, extra) is not None
               for b, i in enumerate(row) if b != a and i != default[b]
               for companion in [find_row({b: i}, sizes, allowed, default)]
               if companion is not None)


def refused_setting_pairs(base: Config) -> List[Tuple[str, str, Refusal]]:
    """(a setting, another, the refusal) for each two settings of OTHER_SETTINGS validation
    refuses together in the all-first-values run, although each runs there alone (e.g. MoE
    and torch.compile)."""
    default = row_of({})
    alone = [(name, extra) for name, extra in OTHER_SETTINGS
             if refusal(base, default, extra) is None]
    out = []
    for i, (name, extra) in enumerate(alone):
        for other, more in alone[i + 1:]:
            why = refusal(base, default, {**extra, **more})
            if why is not None:
                out.append((name, other, why))
    return out


def _where_each_runs(pairs, sizes, allowed, default) -> Row:
    """The default row with what each (axis, value) of `pairs` needs alone, then `pairs`."""
    row = list(default)
    for a, v in pairs:
        alone = find_row({a: v}, sizes, allowed, default)
        for other, (mine, theirs) in enumerate(zip(default, alone or default)):
            if mine != theirs:
                row[other] = theirs
    for a, v in pairs:
        row[a] = v
    return tuple(row)


def _as_combination(named: Dict[str, str]) -> Tuple[Tuple[int, int], ...]:
    names = [a.name for a in AXES]
    return tuple(sorted((names.index(k), AXES[names.index(k)].labels().index(v))
                        for k, v in named.items()))


def tight_combinations() -> List[Tuple[Tuple[int, int], ...]]:
    """Each value of each axis but those of TIGHT, with TIGHT's values."""
    return [_as_combination({**TIGHT, axis.name: label}) for axis in AXES
            if axis.name not in TIGHT for label in axis.labels()]


def matrix_rows(base: Config, strength: int, seed: int = 0
                ) -> Tuple[List[Row], List[Tuple[Dict[str, str], Refusal]]]:
    """The covering array of `strength` over AXES with validation's refusals applied (its
    first rows hold the REGRESSIONS; every value of an axis but precision and fp8 is in a row
    at TIGHT's values), and the refused combinations (of 2 to `strength` values) it leaves
    out, each with its refusal. Raises if the generator meets a combination neither covered
    nor refused."""
    refused = refused_tuples(base, strength)
    gone = {_as_combination(named) for named, _ in refused}
    impossible = [c for c in combinations_of([len(a.values) for a in AXES], strength)
                  if any(sub in gone for k in range(2, strength + 1)
                         for sub in itertools.combinations(c, k))]
    seeds = [dict(_as_combination(named)) for named in REGRESSIONS]
    rows, unreachable = covering_array([len(a.values) for a in AXES], strength,
                                       allowed_rows(base), seed, impossible=impossible,
                                       cost=world_size, seeds=seeds,
                                       required=tight_combinations())
    if unreachable:
        raise RuntimeError(f"combinations neither covered nor refused: {unreachable}")
    return rows, refused
