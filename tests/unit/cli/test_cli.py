"""The commands: console scripts declared in pyproject.toml, each a `main()` in megalite/cli/
(megalite-bench's in megalite_bench/cli.py, the benchmarks' package), scripts/*.py thin
wrappers around them, and an installed package (a wheel, no checkout) that trains with the
same run directory as the scripts."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
COMMANDS = {"pretrain": "pretrain", "prepare": "prepare_data", "plan": "plan",
            "export": "export_hf", "generate": "generate", "bench": "bench",
            "verify_rank": "verify_rank", "evaluate": "evaluate",
            "plot": "plot", "hang_report": "hang_report", "selftest": "selftest",
            "torchrun": "torchrun"}


def command_module(command: str) -> str:
    """The module of a command's `main()`."""
    return "megalite_bench.cli" if command == "bench" else f"megalite.cli.{command}"


def declared_scripts() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_command_is_an_entry_point_with_an_importable_main():
    import importlib

    assert declared_scripts() == {f"megalite-{m.replace('_', '-')}": f"{command_module(m)}:main"
                                  for m in COMMANDS}
    for module in COMMANDS:
        mod = importlib.import_module(command_module(module))
        assert callable(mod.main), module
        assert 'if __name__ == "__main__":\n    main()' in Path(mod.__file__).read_text(), module


@pytest.mark.parametrize("module,script", COMMANDS.items())
def test_scripts_are_documented_wrappers_of_the_commands(module, script):
    source = (REPO / "scripts" / f"{script}.py").read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    assert doc and f"scripts/{script}.py" in doc, doc
    assert f"megalite-{module.replace('_', '-')}" in doc, doc
    assert "sys.path" not in source, "the package is installed (pip install -e .)"
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert [(n.module, [a.name for a in n.names]) for n in imports] == \
        [(command_module(module), ["main"])]
