"""The user's support matrix (docs/support-matrix.md), generated from the feature axes and
validation's refusals (`megalite.config.combinations`), so that it cannot drift from the code:
tests/unit/config/test_combinations.py checks the page equals `render()`, and

    python -m megalite.config.support_matrix > docs/support-matrix.md

rewrites it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megalite.config.combination_search import (
    ep_refusals,
    matrix_rows,
    refused_setting_pairs,
    refused_settings,
    refused_tuples,
)
from megalite.config.combinations import (
    AXES,
    EP_SETTINGS,
    MATRIX_BASE,
    MAX_RANKS,
    OTHER_SETTINGS,
    Refusal,
)
from megalite.config.schema import Config, load_config

SUITE_STRENGTH, BENCH_STRENGTH = 2, 3

INTRO = """# Support matrix

Which features combine. Every feature is an axis with the values below; a combination of
values either runs — and is trained in the test suite against the serial run — or is
refused before launch, before any process group exists, by the configuration check every run
passes (`megalite.config.layout.validate`), with an error naming the key. This page is
generated from that check (`megalite/config/support_matrix.py`; a unit test fails when the
page and the code disagree), so what it says refused is what megalite refuses.

How the combinations are tested is in [Testing combinations](combinations.md).
"""


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _axes_table() -> List[str]:
    lines = ["| feature | values | what |", "|---|---|---|"]
    for axis in AXES:
        lines.append(f"| {axis.name} | {', '.join(axis.labels())} | {_escape(axis.doc)} |")
    return lines


def _values(named: Dict[str, str]) -> str:
    return " + ".join(f"{axis} {value}" for axis, value in named.items())


def _refusals_table(refused: List[Tuple[Dict[str, str], Refusal]]) -> List[str]:
    lines = ["| combination | refused at | megalite's message |", "|---|---|---|"]
    for named, why in refused:
        lines.append(f"| {_values(named)} | `{why.key}` | {_escape(why.message)} |")
    return lines


def _ep_table(tried: List[Tuple[str, Optional[Refusal]]]) -> List[str]:
    given = dict(EP_SETTINGS)
    lines = ["| setting | refused at | megalite's message |", "|---|---|---|"]
    for name, why in tried:
        keys = " ".join(f"{k}={v}" for k, v in given[name].items())
        lines.append(f"| {name} (`{keys}`) | " + ("runs | |" if why is None else
                                                   f"`{why.key}` | {_escape(why.message)} |"))
    return lines


def _settings_table(refused: List[Tuple[Dict[str, str], str, Refusal]]) -> List[str]:
    given = dict(OTHER_SETTINGS)
    lines = ["| feature value | setting | refused at | megalite's message |",
             "|---|---|---|---|"]
    for named, name, why in refused:
        keys = " ".join(f"{k}={v}" for k, v in given[name].items())
        lines.append(f"| {_values(named)} | {name} (`{keys}`) | `{why.key}` | "
                     f"{_escape(why.message)} |")
    return lines


def _setting_pairs_table(refused: List[Tuple[str, str, Refusal]]) -> List[str]:
    lines = ["| setting | with setting | refused at | megalite's message |", "|---|---|---|---|"]
    for name, other, why in refused:
        lines.append(f"| {name} | {other} | `{why.key}` | {_escape(why.message)} |")
    return lines


def render(base: Config) -> str:
    """The page, from `base` (`combinations.MATRIX_BASE` composed)."""
    refused = refused_tuples(base, BENCH_STRENGTH)
    by_megalite = [(n, r) for n, r in refused if r.kind == "megalite"]
    beyond = [(n, r) for n, r in refused if r.kind == "matrix"]
    pairs, _ = matrix_rows(base, SUITE_STRENGTH)
    parts = [INTRO, "## Features", "", *_axes_table(), "",
             "## Refused combinations", "",
             "Every combination of values of two or three features that megalite refuses; a "
             "combination that contains one of these is refused too. Everything else combines.",
             "", *_refusals_table(by_megalite), "",
             "## Settings some feature values refuse", "",
             "Settings the matrix does not vary, each tried beside every feature value (in the "
             f"run where that value runs alone): {', '.join(n for n, _ in OTHER_SETTINGS)}. "
             "Those refused are below; every other pair of a value and a setting runs.", "",
             *_settings_table(refused_settings(base)), "",
             "Two of these settings that megalite refuses together (each runs alone):", "",
             *_setting_pairs_table(refused_setting_pairs(base)), "",
             "## Expert parallelism", "",
             "`ep` > 1 runs with MoE models over the tensor- (with SP), data- and "
             "context-parallel ranks of each pipeline stage (every schedule), ZeRO 0-3, both "
             "dispatchers (docs: "
             "[MoE](moe.md#expert-parallelism)). Each setting below tried "
             "beside the MoE setting at ep 2 over dp 2:", "",
             *_ep_table(ep_refusals(base)), "",
             "## Combinations that run", "",
             f"Every pair of values of two features not refused above runs: the test suite "
             f"trains a covering array of strength 2 ({len(pairs)} runs, every such pair in at "
             "least one, and each value of a feature other than precision and FP8 in at least "
             "one run in fp32 without FP8: the tightest tolerance) against the serial run, and "
             f"`megalite-bench matrix --strength {BENCH_STRENGTH}` one of strength "
             f"{BENCH_STRENGTH} (every such triple; its last result is in [Testing "
             "combinations](combinations.md)).", "",
             f"Not run by the matrix, which keeps a run to {MAX_RANKS} ranks (not a "
             "limit of megalite's):", ""]
    parts += [f"- {_values(n)}: {why.message}" for n, why in beyond]
    return "\n".join(parts) + "\n"


def main() -> None:
    print(render(load_config(MATRIX_BASE)), end="")


if __name__ == "__main__":
    main()
