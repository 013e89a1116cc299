"""Covering arrays of strength t under constraints: a set of rows (one value per axis) in
which every combination of t values of t different axes that some allowed row holds appears
in at least one row. Greedy, one row at a time, as AETG (Cohen et al. 1997, "The AETG
system: an approach to testing based on combinatorial design", IEEE TSE 23(7)): each row
starts from a combination not yet covered, takes for every other axis (in a seeded order) the
value that covers the most new combinations with the values already chosen, and is repaired
until the constraint allows it; the best of a few candidates is kept. Combinations of other
sizes can be required beside them (`required`: e.g. every value of every axis beside two
given values). Deterministic for a seed. The constraint judges whole rows only (`allowed`),
so a combination is known to be impossible only when `find_row` finds no allowed row
holding it.
"""
from __future__ import annotations

import itertools
import random
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

Row = Tuple[int, ...]
Combination = Tuple[Tuple[int, int], ...]  # ((axis, value), ...) with increasing axes


def combinations_of(sizes: Sequence[int], strength: int) -> List[Combination]:
    """Every combination of `strength` values of different axes."""
    out = []
    for axes in itertools.combinations(range(len(sizes)), strength):
        for values in itertools.product(*(range(sizes[a]) for a in axes)):
            out.append(tuple(zip(axes, values)))
    return out


def covered_by(row: Sequence[int], strength: int) -> Set[Combination]:
    return {tuple((a, row[a]) for a in axes)
            for axes in itertools.combinations(range(len(row)), strength)}


def find_row(fixed: Dict[int, int], sizes: Sequence[int], allowed: Callable[[Row], bool],
             near: Sequence[int], changes: int = 2) -> Optional[Row]:
    """An allowed row with the `fixed` values that differs from `near` in at most `changes`
    other axes (nearest first), or None."""
    base = list(near)
    for a, v in fixed.items():
        base[a] = v
    free = [a for a in range(len(sizes)) if a not in fixed]
    for k in range(changes + 1):
        for axes in itertools.combinations(free, k):
            choices = [[v for v in range(sizes[a]) if v != near[a]] for a in axes]
            for values in itertools.product(*choices):
                row = list(base)
                for a, v in zip(axes, values):
                    row[a] = v
                if allowed(tuple(row)):
                    return tuple(row)
    return None


def holds(row: Sequence[int], combo: Combination) -> bool:
    return all(row[a] == v for a, v in combo)


def _gain(row: Dict[int, int], axis: int, value: int, strength: int,
          uncovered: Set[Combination], wanted: Set[Combination]) -> int:
    """New combinations `axis=value` covers with `strength - 1` of the values in `row`, and
    wanted ones it completes with values in `row`."""
    count = 0
    for others in itertools.combinations(sorted(row), strength - 1):
        combo = tuple(sorted([(a, row[a]) for a in others] + [(axis, value)]))
        count += combo in uncovered
    for combo in wanted:
        count += (axis, value) in combo and all(row.get(a) == v for a, v in combo if a != axis)
    return count


def _new(row: Row, strength: int, uncovered: Set[Combination], wanted: Set[Combination]) -> int:
    """The combinations, of `strength` and wanted ones, that `row` covers first."""
    return len(covered_by(row, strength) & uncovered) + sum(holds(row, c) for c in wanted)


def _candidate(start: Combination, sizes: Sequence[int], strength: int,
               uncovered: Set[Combination], wanted: Set[Combination],
               allowed: Callable[[Row], bool], rng: random.Random) -> Optional[Row]:
    """A greedy row holding `start`, repaired towards an allowed one (None if that fails)."""
    row = dict(start)
    rest = [a for a in range(len(sizes)) if a not in row]
    rng.shuffle(rest)
    for axis in rest:
        gains = [_gain(row, axis, v, strength, uncovered, wanted) for v in range(sizes[axis])]
        best = max(gains)
        row[axis] = rng.choice([v for v, g in enumerate(gains) if g == best])
    greedy = tuple(row[a] for a in range(len(sizes)))
    if allowed(greedy):
        return greedy
    return find_row(dict(start), sizes, allowed, greedy)


def covering_array(sizes: Sequence[int], strength: int, allowed: Callable[[Row], bool],
                   seed: int = 0, candidates: int = 16, impossible: Sequence[Combination] = (),
                   cost: Callable[[Row], float] = lambda row: 1.0,
                   seeds: Sequence[Dict[int, int]] = (), required: Sequence[Combination] = ()
                   ) -> Tuple[List[Row], List[Combination]]:
    """(rows, combinations no allowed row was found for): every combination of `strength`
    values not in `impossible`, and every `required` combination (of any size, its axes
    increasing), is in some row, or in the second list. Of the candidates for a row the one
    with the most new combinations per `cost` (e.g. its ranks) is kept. The first rows hold
    the `seeds` (partial rows, {axis: value}), completed greedily."""
    rng = random.Random(seed)
    uncovered = set(combinations_of(sizes, strength)) - set(impossible)
    wanted = set(required)
    rows: List[Row] = []
    unreachable: List[Combination] = []

    def best_of(starts: List[Combination]) -> Optional[Row]:
        best, best_score = None, 0.0
        for _ in range(candidates):
            row = _candidate(rng.choice(starts), sizes, strength, uncovered, wanted, allowed,
                             rng)
            score = 0.0 if row is None else _new(row, strength, uncovered, wanted) / cost(row)
            if score > best_score:
                best, best_score = row, score
        return best

    def take(row: Row) -> None:
        rows.append(row)
        uncovered.difference_update(covered_by(row, strength))
        wanted.difference_update([c for c in wanted if holds(row, c)])

    for partial in seeds:
        row = best_of([tuple(sorted(partial.items()))])
        if row is None:
            raise ValueError(f"no allowed row holds the seed {partial}")
        take(row)
    while uncovered or wanted:
        pending = sorted(uncovered) + sorted(wanted)
        best = best_of(pending)
        if best is None:  # no candidate could be made allowed: the first pending, alone
            combo = pending[0]
            best = find_row(dict(combo), sizes, allowed, [0] * len(sizes))
            if best is None:
                unreachable.append(combo)
                uncovered.discard(combo)
                wanted.discard(combo)
                continue
        take(best)
    return rows, unreachable
