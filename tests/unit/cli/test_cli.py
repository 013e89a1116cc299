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


LIGHT = """
import importlib, sys
main = importlib.import_module("megalite.cli." + sys.argv[1]).main
try:
    main(sys.argv[2:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "hydra", "megalite.model.families",
                           "megalite.config.layout") if m in sys.modules)
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("argv,says", [
    (["plan", "--help"], "usage:"), (["plan", "--world-size", "8", "--device", "nope"], "--device"),
    (["export", "--help"], "usage:"), (["export", "a", "b", "--part", "3/2"], "--part"),
    (["generate", "--help"], "usage:"), (["verify_rank", "--help"], "usage:"),
    (["evaluate", "--help"], "usage:"),
    (["plot", "--help"], "usage:"), (["hang_report", "--help"], "usage:"),
])
def test_help_and_refused_flags_import_no_model_or_torch(argv, says):
    """A command's `--help` and a refused flag answer before torch, the models or Hydra are
    imported (they took 4-6.5 s on a lightly loaded machine when every command imported
    everything): checked in a fresh interpreter, by what it imported, not by time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LIGHT, *argv], capture_output=True, text=True,
                         timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert says in out.stdout + out.stderr


PRETRAIN_REFUSED = """
import sys
from megalite.cli.pretrain import main
sys.argv = ["megalite-pretrain", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    print("EXIT", e.code)
heavy = sorted(m for m in ("torch._dynamo", "torch.distributed.checkpoint", "transformers",
                           "wandb", "datasets") if m in sys.modules)
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("argv,says", [(["train.max_steps=-1"], "train.max_steps"),
                                       (["+train.max_step=30"], "train.max_steps")])
def test_a_refused_pretrain_imports_only_what_the_check_needs(argv, says, tmp_path):
    """megalite-pretrain's refusals need the models' rules (torch) but not the compiler's
    stack (torch._dynamo, a second of CPU, which torch.nn.attention.bias imports), DCP,
    transformers, wandb or datasets: 1.7 s for a refusal at load 3.5 instead of 3.1 s."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PRETRAIN_REFUSED, *argv,
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert "EXIT 2" in out.stdout and "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert says in out.stdout + out.stderr
