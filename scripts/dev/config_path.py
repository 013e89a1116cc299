"""Count the Config's path through `build_trainer` (issue 40's measure): every megalite module a
function of which receives the Config or one of its sections as an argument (not as `self`:
a section's own methods and properties are not counted) while
build_trainer runs as the launch path calls it (`megalite.train.launch`: the config validated
and planned once before, the plan handed in), in call order (consecutive calls in one module
collapsed); the distinct modules (and packages) and how often the path returns to one it had
left.

    PYTHONPATH=. python scripts/dev/config_path.py [overrides...]
"""
import dataclasses
import sys
import tempfile

from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.launch import plan_launch
from megalite.train.runtime import init_runtime


def sections(cfg) -> set:
    found, todo = set(), [cfg]
    while todo:
        obj = todo.pop()
        if id(obj) in found:
            continue
        found.add(id(obj))
        todo += [getattr(obj, f.name) for f in dataclasses.fields(obj)
                 if dataclasses.is_dataclass(getattr(obj, f.name))]
    return found


def main() -> None:
    cfg = load_config(["log.wandb=false", "log.progress=false", *sys.argv[1:]])
    ready = plan_launch(cfg, 1)
    runtime = init_runtime(cfg, ready.layout)
    ids, path = sections(cfg), []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("megalite"):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        args = [frame.f_locals.get(n) for n in names if n != "self"]  # not a section's own
        if any(id(a) in ids for a in args) and (not path or path[-1] != module):
            path.append(module)

    with tempfile.TemporaryDirectory() as run_dir:
        sys.setprofile(profile)
        try:
            build_trainer(cfg, runtime, run_dir, plan=ready.plan)
        finally:
            sys.setprofile(None)
    print("\n".join(path))
    for level, key in (("modules", lambda m: m), ("packages", lambda m: m.split(".")[1])):
        steps = [key(m) for m in path]
        steps = [k for i, k in enumerate(steps) if i == 0 or steps[i - 1] != k]
        returns = sum(k in steps[:i] for i, k in enumerate(steps))
        print(f"{level}: {len(set(steps))} visited, {returns} returns")


if __name__ == "__main__":
    main()
