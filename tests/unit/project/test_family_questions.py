"""The shared machinery asks no family question (docs/models.md): no module of `checkpoint/`
(nor `parallel/`, `plan/`) compares a `model.arch` or names a family, so a family brings its
checkpoint names (its `transformers` mapping, its DCP names) through its `Family`, as a third
family would."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megalite.model.families import families

PACKAGE = Path(__file__).resolve().parents[3] / "megalite"


def family_questions(folder: Path):
    """(file:line, source) of every comparison with an `.arch` and every string constant that
    is a registered family's name, in the modules under `folder`."""
    names = {f.name for f in families()}
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            arch = isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Attribute) and n.attr == "arch"
                for side in (node.left, *node.comparators) for n in ast.walk(side))
            named = isinstance(node, ast.Constant) and node.value in names
            if arch or named:
                found.append(f"{path.relative_to(folder)}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", ["checkpoint", "parallel", "plan"])
def test_the_shared_machinery_asks_no_family_question(package):
    assert family_questions(PACKAGE / package) == []


def test_the_probe_sees_a_family_question(tmp_path):
    """Both forms are found where they stand (the test above can fail)."""
    (tmp_path / "m.py").write_text(
        'def f(cfg):\n    return cfg.model.arch != "x" or cfg.name in ("llama",)\n')
    assert family_questions(tmp_path) == ["m.py:2: cfg.model.arch != 'x'", "m.py:2: 'llama'"]
