"""The GPU-only tests (tests/*/*/test_cuda*.py, skipped without a GPU) checked on CPU, so they
cannot rot unseen: each collects (imports) and is skipped without a GPU, every `from
megalite... import name` in them (function-local ones too) resolves, and every spy or fake
they patch in (`mock.patch.object(target, "name", spy)`, `monkeypatch.setattr(target, "name",
spy)`) accepts every call the real attribute accepts (`inspect.signature`: a spy with one
argument too few is a TypeError at its first call on the GPU). A patch whose target is a local
variable names its class in `LOCAL_TARGETS`; a new one not listed fails here, naming it. And
every CUDA-only branch of megalite/ has a single-GPU test: the branches found in the source
are exactly the ones `cuda_branches` maps to a test (that exists, in a GPU-only file) or,
reached only by NCCL between GPUs, to why; megalite_bench/'s likewise, but for the branches
from before that rule (`BENCH_BEFORE_THE_RULE`).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from megalite.parallel.offload import OptimizerOffload
from megalite.parallel.pipeline import PipelineSchedule
from tests.unit.project.cuda_branches import (
    BENCH_BEFORE_THE_RULE,
    BENCH_SINGLE_GPU,
    SEVERAL_GPUS,
    SINGLE_GPU,
)

TESTS = Path(__file__).resolve().parents[2]
PACKAGE = TESTS.parent / "megalite"
GPU_TESTS = sorted(TESTS.glob("*/*/test_cuda*.py"))
# (file, local variable patched) -> the class of the instance it holds
LOCAL_TARGETS = {("test_cuda_optimizer_offload.py", "offload"): OptimizerOffload,
                 ("test_cuda_optimizer_offload.py", "schedule"): PipelineSchedule}
PATCHERS = {"object", "setattr"}  # mock.patch.object(...), monkeypatch.setattr(...)


def _module_of(path: Path):
    return importlib.import_module(".".join(path.relative_to(TESTS.parent).with_suffix("").parts))


def _patches(tree: ast.AST) -> List[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in PATCHERS
            and len(n.args) == 3 and isinstance(n.args[1], ast.Constant)]


def _signature(args: ast.arguments) -> inspect.Signature:
    """The signature a `def` or `lambda` in the test's source declares (defaults as None)."""
    kind = inspect.Parameter
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    params = [kind(a.arg, kind.POSITIONAL_OR_KEYWORD,
                   default=None if i >= first_default else kind.empty)
              for i, a in enumerate(positional)]
    if args.vararg is not None:
        params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    params += [kind(a.arg, kind.KEYWORD_ONLY, default=None if d is not None else kind.empty)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        params.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(params)


def _spy_signature(tree: ast.AST, spy: ast.expr) -> inspect.Signature:
    if isinstance(spy, ast.Lambda):
        return _signature(spy.args)
    assert isinstance(spy, ast.Name), f"line {spy.lineno}: a spy that is not a def or lambda"
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == spy.id]
    return _signature(fn.args)


def _real(path: Path, module, call: ast.Call) -> Tuple[object, bool]:
    """(the attribute a patch replaces, whether it is called bound: patched on an instance)."""
    target, name = call.args[0], call.args[1].value
    if isinstance(target, ast.Name) and (path.name, target.id) in LOCAL_TARGETS:
        return getattr(LOCAL_TARGETS[path.name, target.id], name), True
    names = dict(vars(module))  # and what the file imports inside its functions
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), str(path), "exec"), names)
    try:
        owner = eval(compile(ast.Expression(target), str(path), "eval"), names)
    except NameError:
        raise AssertionError(f"{path.name}:{call.lineno}: patches {ast.unparse(target)}."
                             f"{name}: name its class in LOCAL_TARGETS") from None
    return getattr(owner, name), False


def _calls(sig: inspect.Signature) -> List[Tuple[tuple, dict]]:
    """The argument shapes a caller may use: the required positionals alone, then every
    positional, each with the required keyword-only arguments."""
    p = inspect.Parameter
    positional = [q for q in sig.parameters.values()
                  if q.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [q for q in positional if q.default is p.empty]
    keywords = {q.name: 0 for q in sig.parameters.values()
                if q.kind is p.KEYWORD_ONLY and q.default is p.empty}
    return [((0,) * len(required), keywords), ((0,) * len(positional), keywords)]


def _spies() -> List[Tuple[str, ast.Call, Path]]:
    out = []
    for path in GPU_TESTS:
        for call in _patches(ast.parse(path.read_text())):
            out.append((f"{path.name}:{call.lineno}:{call.args[1].value}", call, path))
    return out


@pytest.mark.parametrize("where, call, path", _spies(), ids=[s[0] for s in _spies()])
def test_a_gpu_tests_spy_accepts_every_call_of_what_it_replaces(where, call, path):
    module = _module_of(path)
    real, bound = _real(path, module, call)
    real_sig = inspect.signature(real)
    if bound:  # patched on an instance: called without self
        real_sig = real_sig.replace(parameters=list(real_sig.parameters.values())[1:])
    spy_sig = _spy_signature(ast.parse(path.read_text()), call.args[2])
    for args, kwargs in _calls(real_sig):
        try:
            spy_sig.bind(*args, **kwargs)
        except TypeError as e:
            raise AssertionError(f"{where}: the spy {spy_sig} cannot take a call of "
                                 f"{real.__qualname__}{real_sig}: {e}") from None


def _imports() -> Dict[str, Tuple[str, List[str]]]:
    out = {}
    for path in GPU_TESTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    ("megalite", "tests")):
                out[f"{path.name}:{node.lineno}"] = (node.module, [a.name for a in node.names])
    return out


def test_every_import_of_the_gpu_tests_resolves():
    """Module-level and function-local imports of megalite and tests helpers."""
    assert GPU_TESTS and _spies(), "no GPU-only tests found: the glob is stale"
    missing = [f"{where}: from {module} import {name}"
               for where, (module, names) in _imports().items() for name in names
               if not hasattr(importlib.import_module(module), name)
               and importlib.util.find_spec(f"{module}.{name}") is None]
    assert not missing, missing


def _live_device_test(test: ast.expr) -> bool:
    """Whether a branch's condition asks the live device (not a configured device name):
    `<x>.type == "cuda"` or "cpu", `.is_cuda`, a `cuda` flag, `torch.cuda.<call>()`."""
    for n in ast.walk(test):
        if isinstance(n, ast.Attribute) and n.attr in ("is_cuda", "cuda"):
            return True
        if isinstance(n, ast.Name) and n.id == "cuda":
            return True
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(isinstance(x, ast.Attribute) and x.attr == "type" for x in sides) and any(
                    isinstance(x, ast.Constant) and x.value in ("cuda", "cpu") for x in sides):
                return True
    return False


def cuda_branches(root: Path = PACKAGE) -> Dict[str, List[int]]:
    """module:function -> the lines of its CUDA-only branches (`if`, `while`, `x if c else y`)."""
    found: Dict[str, List[int]] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)

        def visit(node: ast.AST, where: List[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, where + [child.name])
                    continue
                if isinstance(child, (ast.If, ast.IfExp, ast.While)) and \
                        _live_device_test(child.test):
                    key = f"{module}:{'.'.join(where) or '<module>'}"
                    found.setdefault(key, []).append(child.lineno)
                visit(child, where)
        visit(ast.parse(path.read_text()), [])
    return found


def test_the_gpu_tests_collect_and_skip_without_a_gpu():
    for path in GPU_TESTS:
        module = _module_of(path)
        marks = getattr(module, "pytestmark", [])
        marks = marks if isinstance(marks, list) else [marks]
        per_test = [getattr(f, "pytestmark", []) for n, f in vars(module).items()
                    if n.startswith("test_")]
        skips = [m for m in marks + [m for ms in per_test for m in ms] if m.name == "skipif"]
        reasons = [m.kwargs.get("reason", "") for m in skips]
        assert any("GPU" in r for r in reasons), f"{path.name}: not skipped without a GPU"


def test_every_cuda_branch_of_megalite_has_a_single_gpu_test():
    found = cuda_branches()
    assert len(found) > 40, "the branch finder found too few: stale"
    listed = set(SINGLE_GPU) | set(SEVERAL_GPUS)
    assert not set(SINGLE_GPU) & set(SEVERAL_GPUS)
    untested = [f"{k} (lines {found[k]})" for k in sorted(set(found) - listed)]
    assert not untested, f"CUDA-only branches without a single-GPU test: {untested}; write " \
        "one (tests/*/*/test_cuda*.py) and name it in tests/unit/project/cuda_branches.py"
    stale = sorted(listed - set(found))
    assert not stale, f"cuda_branches.py names branches megalite/ no longer has: {stale}"
    _named_tests_exist(SINGLE_GPU)


def test_every_new_cuda_branch_of_the_benchmarks_has_a_single_gpu_test():
    """megalite_bench/ likewise, but for the branches from before the rule (listed)."""
    found = cuda_branches(PACKAGE.parent / "megalite_bench")
    assert not set(BENCH_SINGLE_GPU) & BENCH_BEFORE_THE_RULE
    listed = set(BENCH_SINGLE_GPU) | BENCH_BEFORE_THE_RULE
    untested = [f"{k} (lines {found[k]})" for k in sorted(set(found) - listed)]
    assert not untested, f"CUDA-only branches of the benchmarks without a single-GPU test: " \
        f"{untested}; write one (tests/*/*/test_cuda*.py) and name it in BENCH_SINGLE_GPU " \
        "(tests/unit/project/cuda_branches.py)"
    stale = sorted(listed - set(found))
    assert not stale, f"cuda_branches.py names branches megalite_bench/ no longer has: {stale}"
    _named_tests_exist(BENCH_SINGLE_GPU)


def _named_tests_exist(mapped: Dict[str, str]) -> None:
    defined = {str(path.relative_to(TESTS.parent)): {
        n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        for path in GPU_TESTS}
    for branch, node in mapped.items():
        file, test = node.split("::")
        assert file in defined, f"{branch}: {file} is not a GPU-only test file"
        assert test in defined[file], f"{branch}: {file} has no {test}"


def test_the_branch_finder_sees_a_new_cuda_branch(tmp_path):
    """What the check above would say of a new one (a module with a branch of each kind)."""
    package = tmp_path / "megalite"
    package.mkdir()
    (package / "new.py").write_text(
        "def f(x, device, cuda):\n"
        "    if x.device.type == 'cuda':\n        pass\n"
        "    y = 1 if x.is_cuda else 2\n"
        "    while cuda:\n        break\n"
        "    if layout.device_type == 'cuda':  # a configured name: not one\n        pass\n"
        "class C:\n    def g(self):\n        return 1 if self.cuda else 0\n"
        "def h(device):\n    return device.type != 'cpu' and 1\n"
        "def k():\n    return 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    assert cuda_branches(package) == {"megalite.new:f": [2, 4, 5], "megalite.new:C.g": [11],
                                      "megalite.new:k": [15]}
