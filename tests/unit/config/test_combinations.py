"""The combination matrix's axes and refusals (`megalite.config.combinations`) against the
real configuration check, and the support matrix page generated from them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.config.combination_search import matrix_rows, refused_settings, refused_tuples
from megalite.config.combinations import (
    AXES,
    MATRIX_BASE,
    MAX_RANKS,
    OTHER_SETTINGS,
    REGRESSIONS,
    SUITE_SEED,
    TIGHT,
    labels,
    refusal,
    row_config,
    row_of,
    world_size,
)
from megalite.config.covering import combinations_of, covered_by
from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.config.support_matrix import render
from megalite.testing.matrix import TOLERANCES, tolerance_of

PAGE = Path(__file__).parents[3] / "docs" / "support-matrix.md"


@pytest.fixture(scope="module")
def base():
    return load_config(MATRIX_BASE)


def _keys_of(axis_name: str, label: str):
    axis = next(a for a in AXES if a.name == axis_name)
    return list(axis.values[axis.labels().index(label)].settings)


def test_every_refused_pair_is_refused_by_validation_naming_its_keys(base):
    """Each pair the matrix leaves out is refused by `validate` (the check every launch runs
    before any process group exists), with an error that starts with the key it refuses and
    names a key of each of the pair's two values."""
    refused = refused_tuples(base, 2)
    assert len(refused) >= 7  # gpt2 untied, sp without tp, schedules at pp=1, zb x offload
    for named, why in refused:
        assert why.kind == "megalite", (named, why)
        row = row_of(named)
        with pytest.raises(ConfigError) as err:
            validate(row_config(base, row), world_size(row))
        assert str(err.value).startswith(f"{err.value.key}="), err.value
        message = why.message
        assert message.startswith(f"{why.key}="), why
        for axis_name, label in named.items():
            keys = _keys_of(axis_name, label) or ["dp"]  # dp: the world size's, no key
            assert any(k in message for k in keys), \
                (named, axis_name, keys, message)
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def suite_array(base):
    return matrix_rows(base, 2, SUITE_SEED)


def test_the_array_covers_every_pair_that_runs(base, suite_array):
    rows, refused = suite_array
    gone = {tuple(sorted((_axis_index(a), _value_index(a, v)) for a, v in n.items()))
            for n, _ in refused}
    covered = set().union(*(covered_by(r, 2) for r in rows))
    sizes = [len(a.values) for a in AXES]
    assert set(combinations_of(sizes, 2)) - gone == covered
    assert all(refusal(base, r) is None for r in rows)
    assert all(world_size(r) <= MAX_RANKS for r in rows)
    assert len(rows) <= 30  # the suite's budget: 29 at SUITE_SEED
    for regression in REGRESSIONS:  # in the first rows, whatever the strength
        assert any(all(labels(r)[k] == v for k, v in regression.items()) for r in rows)
    # cp multiplies the world (tp*cp*pp*dp): 10 of the 29 runs at SUITE_SEED have 8 ranks
    assert sum(world_size(r) > 4 for r in rows) <= len(rows) // 2


def test_every_value_runs_at_the_tightest_tolerance(suite_array):
    """Every value of every axis but precision and FP8 is in a run in fp32 without FP8 (held
    to 1e-5), not only beside bf16 or FP8, whose bounds would pass a defect of 1e-4."""
    rows, _ = suite_array
    tight = [labels(r) for r in rows if all(labels(r)[k] == v for k, v in TIGHT.items())]
    tightest = min(TOLERANCES.values(), key=lambda t: t.loss)
    assert tolerance_of(row_of(TIGHT)) == tightest and tightest.loss == 1e-5
    for axis in AXES:
        if axis.name not in TIGHT:
            missing = set(axis.labels()) - {t[axis.name] for t in tight}
            assert not missing, (axis.name, missing)


def test_settings_a_value_refuses_are_refused_by_validation_naming_both(base):
    """Each (axis value, setting the matrix does not vary) the support matrix lists refused:
    validation's message names a key of the setting and a key of the value; the setting alone
    runs. cp 2 refuses attention dropout (CP attention has none), in both comm modes."""
    given = dict(OTHER_SETTINGS)
    refused = refused_settings(base)
    listed = [(named, name) for named, name, _ in refused]
    for comm in ("2 allgather", "2 ring"):
        assert ({"cp": comm}, "attention dropout") in listed, listed
        assert ({"cp": comm}, "a named document kernel") in listed, listed
    for named, name, why in refused:
        assert why.kind == "megalite" and why.message.startswith(f"{why.key}="), why
        assert any(k in why.message for k in given[name]), (name, why)
        ((axis_name, label),) = named.items()
        assert any(k in why.message for k in _keys_of(axis_name, label)), (named, why)
        assert refusal(base, row_of({}), given[name]) is None, name


def _axis_index(name):
    return [a.name for a in AXES].index(name)


def _value_index(name, label):
    return AXES[_axis_index(name)].labels().index(label)


def test_a_run_over_the_rank_limit_is_the_matrix_s_not_megalite_s(base):
    row = row_of({"tp": "2", "pp": "4", "dp": "2"})
    why = refusal(base, row)
    assert (why.kind, world_size(row)) == ("matrix", 16)
    validate(row_config(base, row), 16)  # megalite itself runs it


def test_the_support_matrix_page_is_what_the_rules_give(base):
    """docs/support-matrix.md is generated; rewrite it with
    `python -m megalite.config.support_matrix > docs/support-matrix.md`."""
    assert PAGE.read_text() == render(base)
