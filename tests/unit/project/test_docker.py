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
import re
from pathlib import Path
from typing import List, Tuple

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
SECRET_WORDS = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)


def instructions(text: str) -> List[Tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comment lines dropped (also
    inside a continuation, as Docker does)."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, f"dangling line continuation: {current!r}"
    return out


def only(instrs, keyword: str) -> List[str]:
    return [args for k, args in instrs if k == keyword]


def exec_form(args: str) -> List[str]:
    value = json.loads(args)  # shell form would fail here: exec form is required
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_vars(instrs) -> dict:
    """ENV key=value pairs (quoted values allowed)."""
    env = {}
    for args in only(instrs, "ENV"):
        for key, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', args):
            env[key] = value.strip('"')
    return env


def build_args(instrs) -> dict:
    out = {}
    for args in only(instrs, "ARG"):
        key, _, default = args.partition("=")
        out[key.strip()] = default.strip().strip('"') or None
    return out


def expand(value: str, variables: dict) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: str(variables.get(m.group(1), m.group(0))), value)


@pytest.fixture(scope="module")
def df():
    return instructions(DOCKERFILE.read_text())


def _pattern_regex(pattern: str) -> re.Pattern:
    pat, out, i = os.path.normpath(pattern.strip().lstrip("/")), "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pat[i] == "[":
            end = pat.index("]", i)
            out, i = out + pat[i:end + 1].replace("[!", "[^"), end + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def dockerignore_rules() -> List[Tuple[bool, re.Pattern]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line[1:] if negate else line)))
    return rules


def excluded(path: str, rules) -> bool:
    """Is `path` (relative to the context root) left out of the build context?"""
    parts = path.split("/")
    state = False
    for negate, regex in rules:
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            state = not negate
    return state


def context_files(source: str) -> List[str]:
    root = REPO / source
    if root.is_file():
        return [source]
    return sorted(str(p.relative_to(REPO)) for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def pip_target(run: str) -> str:
    """The one thing `pip install` installs in a RUN line (options and their values skipped)."""
    command = next(c for c in run.split("&&") if "pip install" in c)
    tokens = command.split()
    tokens = tokens[tokens.index("install") + 1:]
    with_value = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "-t",
                  "--target", "--extra-index-url", "-f", "--find-links"}
    targets, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token.startswith("-"):
            skip = token in with_value
        else:
            targets.append(token)
    assert len(targets) == 1, f"expected one install target: {command}"
    return targets[0]


def test_base_image_is_a_pinned_cuda_pytorch_whose_torch_satisfies_pyproject(df):
    froms = only(df, "FROM")
    assert len(froms) == 1, froms
    image = expand(froms[0].split()[0], build_args(df))
    official = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime",
                            image)
    ngc = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", image)
    assert official or ngc, f"{image}: expected pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-" \
                            "runtime or nvcr.io/nvidia/pytorch:<yy.mm>-py3, pinned by tag"
    if official:
        requirement = re.search(r'"torch\s*([<>=!~][^"]*)"', (REPO / "pyproject.toml").read_text())
        assert requirement, "pyproject.toml declares no torch requirement"
        spec = SpecifierSet(requirement.group(1))
        assert Version(official.group(1)) in spec, \
            f"the image's torch {official.group(1)} does not satisfy pyproject's torch{spec}"


def test_megalite_is_installed_from_the_copied_source_without_replacing_torch(df):
    workdir, copied = "/", {}
    for keyword, args in df:
        if keyword == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, args))
        elif keyword == "COPY":
            assert not args.startswith("--from"), args
            *sources, dest = args.split()
            dest = os.path.normpath(os.path.join(workdir, dest))
            for src in sources:
                copied[src] = dest if len(sources) == 1 and not args.rstrip().endswith("/") \
                    else os.path.join(dest, os.path.basename(src))
        elif keyword == "RUN" and "pip install" in args:
            pip_run = args
            break
    else:
        pytest.fail("no RUN pip install")
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    needed = {"pyproject.toml", "megalite", "conf", "scripts"} | ({readme.group(1)} if readme else set())
    assert needed <= set(copied), f"not copied before the install: {needed - set(copied)}"
    project = os.path.dirname(copied["pyproject.toml"])
    assert copied["megalite"] == os.path.join(project, "megalite"), copied
    # pip installs that directory (non-editable), constrained to the base image's torch
    assert os.path.normpath(os.path.join(workdir, pip_target(pip_run))) == project, pip_run
    assert "--constraint" in pip_run and "torch==" in pip_run, \
        "pip must be constrained to the image's torch (never reinstall it)"
    assert "-e " not in pip_run and "--editable" not in pip_run
    # every source exists and is part of the build context
    rules = dockerignore_rules()
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: missing from the repository " \
                                      f"(docker build, and pip install of pyproject.toml, need it)"
        files = context_files(src)
        assert files, src
        dropped = [f for f in files if excluded(f, rules)]
        assert not dropped, f".dockerignore drops files the image needs: {dropped[:5]}"


def test_runs_as_a_non_root_user_with_writable_caches(df):
    users = only(df, "USER")
    assert users, "no USER: the container would run as root"
    last_user = expand(users[-1], build_args(df)).split(":")[0]
    assert last_user not in ("root", "0"), users[-1]
    assert re.fullmatch(r"\d+", last_user), f"USER {users[-1]}: numeric (runAsNonRoot) expected"
    # the USER comes after the last RUN: nothing runs as root at container start
    order = [k for k, _ in df]
    assert max(i for i, k in enumerate(order) if k == "USER") > \
        max(i for i, k in enumerate(order) if k == "RUN")
    env = env_vars(df)
    setup = " ".join(only(df, "RUN"))
    for key in ("HF_HOME", "WANDB_DIR"):
        assert key in env, f"ENV {key} unset"
        owned = [d for d in re.findall(r"chown\s+(?:-R\s+)?\S+\s+(\S+)", setup)
                 if env[key].startswith(d.rstrip("/") + "/")]
        assert owned, f"{key}={env[key]} is not under a directory chown-ed to the user"
    assert env.get("WANDB_DIR", "").startswith(only(df, "WORKDIR")[-1])


def test_no_secrets_in_the_image(df):
    for key in list(env_vars(df)) + list(build_args(df)):
        assert not SECRET_WORDS.search(key), f"{key}: secrets come from `docker run -e`, never " \
                                             f"from the image"
    for args in only(df, "COPY") + only(df, "ADD"):
        assert not re.search(r"(\.env\b|netrc|\.pem|id_rsa|credentials)", args), args
    rules = dockerignore_rules()
    for path in (".git/config", ".env", "wandb/settings", "outputs/run/metrics.jsonl",
                 "data/stdlib/meta.json", "sub/.netrc", ".venv/bin/python"):
        assert excluded(path, rules), f"{path} would be sent into the build context"


def test_entrypoint_is_torchrun_and_the_default_command_trains(df):
    entrypoints, cmds = only(df, "ENTRYPOINT"), only(df, "CMD")
    assert len(entrypoints) == 1 and exec_form(entrypoints[0]) == ["torchrun"]
    assert len(cmds) == 1
    cmd = exec_form(cmds[0])
    script = next(a for a in cmd if a.endswith(".py"))
    assert script.endswith("/scripts/pretrain.py") and os.path.isabs(script), \
        f"{script}: the working directory is the user's workspace, so an absolute path"
    assert any(a.startswith("--nproc_per_node") for a in cmd)


def test_dockerignore_matcher_follows_docker_rules():
    rules = [(False, _pattern_regex("data")), (False, _pattern_regex("**/__pycache__")),
             (False, _pattern_regex("*.log")), (True, _pattern_regex("keep.log"))]
    assert excluded("data/x.bin", rules) and not excluded("megalite/data/loader.py", rules)
    assert excluded("megalite/__pycache__/a.pyc", rules) and excluded("__pycache__/a", rules)
    assert excluded("a.log", rules) and not excluded("keep.log", rules)
    assert not excluded("sub/a.log", rules)  # patterns are anchored at the context root
