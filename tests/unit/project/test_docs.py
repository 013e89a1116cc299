"""Every training launch written in the docs is a configuration that `validate()` accepts at
the world size the command starts (torchrun's nodes x processes per node, sbatch's nodes x GPUs
per node), so a user who copies one is not refused on the cluster; the configuration reference
(docs/configuration.md) names every key of the schema; the ZeRO page shows the plan's table;
every page of docs/ is in mkdocs.yml's nav; and the README stays short."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from megalite.config.layout import validate
from megalite.config.schema import load_config

REPO = Path(__file__).resolve().parents[3]
PAGES = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))  # the site
DOCS = ["README.md", "docker/README.md", "scripts/slurm/README.md",
        "scripts/slurm/pretrain.sbatch", "conf/config.yaml", *PAGES]
# the documents that show at least one training launch (the extractor must find it there)
WITH_LAUNCHES = {"README.md", "docker/README.md", "scripts/slurm/README.md",
                 "scripts/slurm/pretrain.sbatch", "conf/config.yaml", "docs/index.md",
                 "docs/getting-started.md", "docs/clusters.md", "docs/data.md",
                 "docs/planner.md", "docs/evaluation.md", "docs/rerun.md",
                 "docs/observability.md", "docs/models.md"}
CONFIG_PAGE = "docs/configuration.md"  # the configuration reference
ZERO_PAGE = "docs/zero.md"  # where `zero_table()` is shown
README_MAX_LINES = 260
GPUS_PER_NODE = 8  # what `--nproc_per_node=gpu` starts on the nodes the docs have in mind
LAUNCHERS = ("torchrun", "sbatch ", "docker run", "python ")


def logical_lines(text: str) -> List[str]:
    """Lines with backslash continuations joined; comment markers of shell/YAML examples
    (`#   torchrun ...`) dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = re.sub(r"^\s*#\s?", "", raw).strip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    return out


def _flag(line: str, name: str) -> Optional[str]:
    match = re.search(rf"{name}[= ](\S+)", line)
    return match.group(1) if match else None


def launch(line: str) -> Optional[Tuple[int, int, List[str]]]:
    """(world size, processes per node, overrides) of a training launch; None for other lines,
    for launches with placeholders (`...`, `<overrides>`) or whose size the line does not
    say, and for a terminal transcript's command (`$ ...`: its output is shown beside it,
    e.g. a refusal)."""
    if line.startswith("$ "):
        return None
    script = re.search(r"\S*scripts/(?:slurm/)?pretrain\.(?:py|sbatch)\b|"
                       r"(?<![\w`/-])megalite-pretrain\b(?!`)", line)
    if not script or not (any(word in line[:script.start()] for word in LAUNCHERS)
                          or (script.start() == 0 and script.group() == "megalite-pretrain")):
        return None
    if "sbatch" in line[:script.start()]:
        nodes, per_node = _flag(line, "--nodes"), _flag(line, "--gpus-per-node")
    elif "torchrun" in line or "docker run" in line:
        nodes, per_node = _flag(line, "--nnodes") or "1", _flag(line, "--nproc_per_node")
    else:
        nodes, per_node = "1", "1"
    rest = line[script.end():].split()
    if nodes is None or per_node is None or any(w == "..." or w.startswith("<") for w in rest):
        return None
    per_node = str(GPUS_PER_NODE) if per_node == "gpu" else per_node
    overrides = [w for w in rest if re.match(r"^[\w.]+=", w) and not w.startswith("hydra")]
    return int(nodes) * int(per_node), int(per_node), overrides


def documented_launches() -> List[Tuple[str, int, int, List[str]]]:
    found = []
    for doc in DOCS:
        for line in logical_lines((REPO / doc).read_text()):
            parsed = launch(line)
            if parsed is not None:
                found.append((doc, *parsed))
    return found


def test_the_extractor_reads_the_launch_forms():
    assert launch("torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=x scripts/pretrain.py "
                  "hydra.run.dir=o model=gpt2 tp=2") == (16, 8, ["model=gpt2", "tp=2"])
    assert launch("sbatch --nodes=4 --gpus-per-node=8 scripts/slurm/pretrain.sbatch zero=1") \
        == (32, 8, ["zero=1"])
    assert launch("python scripts/pretrain.py") == (1, 1, [])
    assert launch("megalite-pretrain model=gpt2 tp=2") == (1, 1, ["model=gpt2", "tp=2"])
    assert launch("torchrun --nproc_per_node=4 --no-python megalite-pretrain zero=1") == \
        (4, 4, ["zero=1"])
    assert launch("`megalite-pretrain` runs scripts/pretrain.py's code") is None
    assert launch("VENV=$PWD/.venv sbatch scripts/slurm/pretrain.sbatch ...") is None
    assert launch("    pretrain=$MEGALITE_DIR/scripts/pretrain.py") is None
    assert launch("$ megalite-torchrun --nproc_per_node=2 scripts/pretrain.py tp=3") is None
    found = documented_launches()
    assert len(found) >= 20, found
    assert WITH_LAUNCHES <= {doc for doc, *_ in found}, found
    assert len(PAGES) >= 15 and CONFIG_PAGE in PAGES and ZERO_PAGE in PAGES, PAGES


@pytest.mark.parametrize("doc,world,per_node,overrides", documented_launches(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_documented_launch_is_valid(doc, world, per_node, overrides):
    cfg = load_config(overrides)
    validate(cfg, world, local_gpus=None if world == 1 else per_node, local_ranks=per_node)


def test_every_config_key_is_in_the_configuration_reference():
    """The configuration reference's table names every field of the schema (a `group.*` row
    may list the group's fields by name)."""
    from dataclasses import fields, is_dataclass

    from megalite.config.schema import Config

    table = (REPO / CONFIG_PAGE).read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| `")}
    missing = []
    defaults = Config()
    for top in fields(Config):
        if not is_dataclass(getattr(defaults, top.name)):
            if f"`{top.name}`" not in table:
                missing.append(top.name)
            continue
        group = top.name
        star = next((line for key, line in rows.items() if key == f"`{group}.*`"), "")
        for sub in fields(getattr(defaults, group)):
            if f"`{group}.{sub.name}`" not in table and not re.search(rf"\b{sub.name}\b", star):
                missing.append(f"{group}.{sub.name}")
    assert not missing, f"{CONFIG_PAGE}'s configuration table lacks {missing}"


def test_the_documented_zero_table_is_the_plans():
    """One home for the ZeRO table: the ZeRO page shows `megalite.plan.zero_table.zero_table()`
    verbatim."""
    from megalite.plan.zero_table import zero_table

    assert zero_table() in (REPO / ZERO_PAGE).read_text()


def _nav_pages(node) -> List[str]:
    """The page paths in (a part of) mkdocs.yml's nav: strings, lists, {title: node}."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_mkdocs_nav():
    """Beside `mkdocs build --strict` (validation.nav.omitted_files): no page of docs/ is an
    orphan, and the nav names no page that does not exist."""
    import yaml

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    nav = _nav_pages(config["nav"])
    pages = [page[len("docs/"):] for page in PAGES]
    assert sorted(nav) == sorted(set(nav)), f"pages listed twice in the nav: {nav}"
    assert set(pages) - set(nav) == set(), "docs/ pages missing from mkdocs.yml's nav"
    assert set(nav) - set(pages) == set(), "nav entries without a page in docs/"


def test_the_readme_stays_short():
    """The README is the front page; the rest lives in docs/."""
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_ci_runs_the_documented_test_command():
    """`.ci/run` runs the test command the README and the contributor's page show, verbatim:
    the whole suite, then the loss tests again on the AVX2 and plain CPU kernels."""
    script = [line for line in (REPO / ".ci/run").read_text().splitlines()
              if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(script) == 1, script
    command = script[0].strip()
    assert command.startswith("pip install torch==") and "&& python -m pytest -q &&" in command
    for capability in ("avx2", "default"):  # the CPU kernels other machines have
        assert f"ATEN_CPU_CAPABILITY={capability} python -m pytest -q tests/" in command
    assert command.endswith("&& bash docker/check.sh")  # the image check: last, named
    for doc in ("README.md", "docs/contributing.md"):
        shown = [line.strip() for line in (REPO / doc).read_text().splitlines()]
        assert command in shown, f"{doc} does not show .ci/run's command: {command}"
