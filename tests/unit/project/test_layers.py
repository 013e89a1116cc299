"""The house rules import-linter does not check (its contracts in pyproject.toml hold the layers
and the absence of cycles, run by `lint-imports` in the README's test command): no module
imports another module's private (underscore) name, and re-exports (`noqa: F401`) stand only
in a package's `__init__`, which defines its public API."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "megalite"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def private_imports():
    """(file, module, name) of every `from megalite... import _name` (a submodule named with
    an underscore would be a private module, which megalite has none of)."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megalite"):
                found += [(path.name, node.module, a.name) for a in node.names
                          if a.name.startswith("_")]
    return found


def test_no_module_imports_another_modules_private_name():
    assert private_imports() == []


def test_re_exports_stand_only_in_a_package_init():
    outside = [f"{path.relative_to(PACKAGE)}:{i}" for path, _ in _modules()
               if path.name != "__init__.py"
               for i, line in enumerate(path.read_text().splitlines(), 1)
               if "noqa: F401" in line and "import torch._dynamo" not in line
               and "import transformers" not in line]  # imported for their side effects
    assert outside == []


def test_the_layers_contract_names_every_package():
    """`exhaustive = true` makes import-linter refuse a package the layers leave out; the list
    here is what the docs' module map shows."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML itself")

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["type"]: c for c in config["contracts"] if c.get("containers") != ["megalite"]}
    (megalite,) = [c for c in config["contracts"] if c.get("containers") == ["megalite"]]
    named = {name.strip() for layer in megalite["layers"] for name in layer.split("|")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert named == packages
    assert megalite["exhaustive"] is True
    assert contracts["acyclic_siblings"]["ancestors"] == ["megalite", "megalite_bench"]
    # the benchmarks sit above the commands, and the product never imports them
    assert contracts["layers"]["layers"] == ["megalite_bench", "megalite.cli"]
    assert contracts["forbidden"]["forbidden_modules"] == ["megalite_bench"]
