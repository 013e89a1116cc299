"""The optional extras of pyproject.toml: which of their modules this environment lacks, and the
command that installs one.

The `eval` extra brings lm-eval and accelerate (megalite-evaluate) and matplotlib
(megalite-plot); the quickstart's `pip install -e .` does not. A command or message that needs
one says so with `install_hint`: from a checkout (an editable install, or the checkout on
PYTHONPATH) `pip install -e ".[eval]"` (the checkout's path in place of `.` when the current
directory is elsewhere), and for an installed wheel (the Docker image) the extra's
requirements by name, as the installed metadata lists them.
"""
from __future__ import annotations

import importlib.util
import shlex
from importlib import metadata
from pathlib import Path
from typing import List, Optional

# extra -> the modules its commands import (module names, not distribution names)
EXTRA_MODULES = {"eval": ("lm_eval", "accelerate", "matplotlib")}
# the distributions of those modules, for messages
DISTRIBUTIONS = {"lm_eval": "lm-eval", "accelerate": "accelerate", "matplotlib": "matplotlib"}


def missing(*modules: str) -> List[str]:
    """The distribution names of `modules` that cannot be imported here (found without
    importing them)."""
    out = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(DISTRIBUTIONS.get(module, module))
    return out


def checkout_root() -> Optional[Path]:
    """The checkout megalite is imported from (the directory holding its pyproject.toml), or
    None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        if pyproject.is_file() and 'name = "megalite"' in pyproject.read_text():
            return root
    except OSError:
        pass
    return None


def install_hint(extra: str = "eval") -> str:
    """The command that installs `extra` into this environment."""
    root = checkout_root()
    if root is not None:
        if Path.cwd().resolve() == root:
            return f'pip install -e ".[{extra}]"'
        return f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
    try:
        requires = metadata.requires("megalite") or []
    except metadata.PackageNotFoundError:
        requires = []
    named = [r.split(";")[0].strip() for r in requires
             if f'extra == "{extra}"' in r.replace("'", '"')]
    names = named or [DISTRIBUTIONS.get(m, m) for m in EXTRA_MODULES.get(extra, ())]
    return "pip install " + " ".join(shlex.quote(n) for n in names)
