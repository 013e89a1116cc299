"""Config composition and validation: every bad value is refused naming key, value and remedy."""
import pytest


@pytest.mark.distributed
def test_an_installed_package_carries_its_configs(tmp_path):
    """A wheel of megalite (what `pip install .` and the Docker image install) holds the Hydra
    configs, so `load_config` works from site-packages, outside the checkout."""
    import os
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(repo)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "wheel").glob("megalite-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"megalite/conf/{p.relative_to(repo / 'conf').as_posix()}"
               for p in (repo / "conf").rglob("*.yaml")}  # hydra/job_logging/ too
    assert configs <= packaged, f"pyproject.toml's package-data misses {configs - packaged}"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import megalite, megalite.config.schema as c; "
             "assert megalite.__file__.startswith(%r), megalite.__file__; "
             "print(c.load_config(['model=gpt2-xl']).model.n_layer)" % str(site))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "48"
