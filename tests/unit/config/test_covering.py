"""The covering-array generator (`megalite.config.covering`): every combination of t values
is in some row, constraints hold, the result is deterministic and not much larger than the
known optimum."""
from __future__ import annotations

import pytest

from megalite.config.covering import combinations_of, covered_by, covering_array, find_row


def _all_allowed(row) -> bool:
    return True


def _assert_covers(rows, sizes, strength, skip=()):
    covered = set().union(*(covered_by(r, strength) for r in rows))
    missing = set(combinations_of(sizes, strength)) - covered - set(skip)
    assert not missing, sorted(missing)[:5]


@pytest.mark.parametrize("sizes,strength,bound", [
    ([3, 3, 3, 3], 2, 12),  # optimum 9 (an orthogonal array)
    ([2] * 10, 2, 10),  # optimum 6
    ([4, 3, 2, 2, 3], 2, 16),  # optimum 12 (4 x 3)
    ([2] * 6, 3, 16),  # optimum 12
    ([3, 2, 2, 2, 3], 3, 27),  # optimum 18
])
def test_every_combination_is_covered_in_few_rows(sizes, strength, bound):
    rows, unreachable = covering_array(sizes, strength, _all_allowed, seed=0)
    assert unreachable == []
    _assert_covers(rows, sizes, strength)
    assert len(rows) <= bound, len(rows)
    assert all(len(r) == len(sizes) and all(0 <= v < n for v, n in zip(r, sizes)) for r in rows)


def test_the_same_seed_gives_the_same_rows():
    sizes = [3, 2, 4, 2, 3]
    assert covering_array(sizes, 2, _all_allowed, seed=7) == covering_array(sizes, 2,
                                                                            _all_allowed, seed=7)


def test_a_forbidden_pair_is_in_no_row_and_reported_not_dropped():
    """Axis 0 value 0 never goes with axis 1 value 0; axis 2 value 1 needs axis 3 value 1
    (an allowed row exists for every other pair, but not next to the first values)."""
    def allowed(row):
        return not (row[0] == 0 and row[1] == 0) and (row[2] != 1 or row[3] == 1)

    sizes = [2, 2, 3, 2]
    rows, unreachable = covering_array(sizes, 2, allowed, seed=0)
    assert all(allowed(r) for r in rows)
    assert set(unreachable) == {((0, 0), (1, 0)), ((2, 1), (3, 0))}
    _assert_covers(rows, sizes, 2, skip=unreachable)
    rows, unreachable = covering_array(sizes, 2, allowed, impossible=unreachable)
    assert unreachable == []  # told in advance: neither searched for nor reported again


def test_cost_prefers_cheap_rows():
    """With rows costing their axis-0 value + 1, the expensive value appears only as often
    as its own pairs need."""
    sizes = [3, 2, 2, 2]
    rows, _ = covering_array(sizes, 2, _all_allowed, cost=lambda r: 1 + 10 * r[0])
    assert sum(r[0] == 2 for r in rows) == 2  # value 2 with each of axis 1's two values
    _assert_covers(rows, sizes, 2)


def test_find_row_searches_near_the_given_row():
    def allowed(row):
        return row[1] == row[2]

    assert find_row({0: 1, 1: 1}, [2, 2, 2], allowed, [0, 0, 0]) == (1, 1, 1)
    assert find_row({1: 1, 2: 0}, [2, 2, 2], allowed, [0, 0, 0]) is None
    only = [(1, 1, 1, 1)]  # three changes away from (1, 0, 0, 0)
    assert find_row({}, [2] * 4, lambda r: r in only, [1, 0, 0, 0], changes=3) == only[0]
    assert find_row({}, [2] * 4, lambda r: r in only, [1, 0, 0, 0], changes=2) is None


def test_seeds_start_the_array():
    sizes = [3, 3, 2, 2]
    rows, _ = covering_array(sizes, 2, _all_allowed, seeds=[{0: 2, 1: 1}, {2: 1, 3: 0}])
    assert rows[0][:2] == (2, 1) and rows[1][2:] == (1, 0)
    _assert_covers(rows, sizes, 2)
    with pytest.raises(ValueError, match="seed"):
        covering_array(sizes, 2, lambda r: r[0] != 2, seeds=[{0: 2}])


def test_required_combinations_are_each_in_a_row():
    """Every value of axes 0-2 beside axis 3 = 1 and axis 4 = 0 (as the matrix asks for every
    value in fp32 without FP8), on top of the pairs; one that no allowed row holds is
    reported."""
    sizes = [3, 2, 3, 2, 2]
    required = [tuple(sorted({a: v, 3: 1, 4: 0}.items())) for a in range(3)
                for v in range(sizes[a])]
    rows, unreachable = covering_array(sizes, 2, _all_allowed, required=required)
    assert unreachable == []
    assert all(any(all(r[a] == v for a, v in c) for r in rows) for c in required)
    _assert_covers(rows, sizes, 2)

    def allowed(row):  # axis 0 value 2 never beside axis 3 value 1 and axis 4 value 0
        return not (row[0] == 2 and row[3] == 1 and row[4] == 0)

    rows, unreachable = covering_array(sizes, 2, allowed, required=required)
    assert unreachable == [((0, 2), (3, 1), (4, 0))]
    assert all(allowed(r) for r in rows)
    _assert_covers(rows, sizes, 2)
