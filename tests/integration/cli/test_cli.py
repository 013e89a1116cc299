"""The commands: console scripts declared in pyproject.toml, each a `main()` in megalite/cli/,
scripts/*.py thin wrappers around them, and an installed package (a wheel, no checkout) that
trains with the same run directory as the scripts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.unit.cli.test_cli import COMMANDS, REPO


@pytest.mark.distributed
@pytest.mark.slow
def test_a_command_runs_as_a_module_and_with_argv():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "megalite.cli.plan", "--help"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "--world-size" in proc.stdout, proc.stderr
    from megalite.cli import plan

    with pytest.raises(SystemExit) as exit_:
        plan.main(["--world-size", "0"])
    assert exit_.value.code == 2
    installed = shutil.which("megalite-plan")  # an environment that installed this version
    if installed:
        proc = subprocess.run([installed, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "--world-size" in proc.stdout, proc.stderr


def running_site_dirs() -> list:
    """The site-packages directories this interpreter reads its packages from: its own (a
    virtual environment's, plus the base interpreter's when that one was made with
    --system-site-packages), and the user site when it is on."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def inherit_site_packages(venv: Path) -> Path:
    """A .pth file in `venv`'s site-packages that adds this interpreter's site directories
    after its own, their .pth files processed, as --system-site-packages would on a bare
    interpreter. (`venv --system-site-packages` run from inside a virtual environment inherits
    the base interpreter's packages, not this environment's: no torch there.)"""
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    pth = site_packages / "_megalite_test_inherit.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n"
                           for d in running_site_dirs()))
    return pth


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtualenv with megalite installed from its wheel (the dependencies come from this
    environment's site-packages, a virtual environment's too): the console scripts, and no
    checkout on the path."""
    tmp = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp / "wheel"), str(REPO)],
                   check=True, cwd=tmp)
    (wheel,) = (tmp / "wheel").glob("megalite-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    inherit_site_packages(tmp / "venv")
    # --ignore-installed: this environment's megalite (an editable install, or a checkout on
    # PYTHONPATH) is neither "already satisfied" nor touched
    subprocess.run([sys.executable, "-m", "pip", "--python", str(tmp / "venv" / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   check=True)
    return tmp / "venv"


def run_installed(venv: Path, command: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    return subprocess.run([str(venv / "bin" / command), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
def test_the_installed_commands_run_without_a_checkout(venv, tiny_data, tmp_path):
    """`megalite-pretrain` from the wheel: the package's configs, the run directory where
    hydra.run.dir says, rank 0's messages once on stderr and once in <run dir>/pretrain.log."""
    assert {f"megalite-{m.replace('_', '-')}" for m in COMMANDS} <= {p.name for p in (venv / "bin").iterdir()}
    where = run_installed(venv, "python", "-c", "import megalite; print(megalite.__file__)",
                          cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    helped = run_installed(venv, "megalite-plan", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--world-size" in helped.stdout, helped.stderr
    run = tmp_path / "run"
    proc = run_installed(venv, "megalite-pretrain", f"hydra.run.dir={run.name}",
                         f"data.dir={tiny_data}", *TINY, "train.max_steps=2",
                         "train.eval_every=0", "log.every=1", "log.wandb=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "metrics.jsonl").is_file() and (run / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no outputs/ of its own
    line = f"run_dir={run}"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    logged = (run / "pretrain.log").read_text()
    assert logged.count(line) == 1 and "[megalite][rank 0][INFO]" in logged, logged
