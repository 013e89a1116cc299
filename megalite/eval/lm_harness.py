"""A run's model under EleutherAI's lm-eval harness (`lm_eval.simple_evaluate`, model `hf`).

lm-eval reads `transformers` models, so a megalite checkpoint is exported first
(`megalite.checkpoint.export.export_hf`: config, safetensors weights, the run's tokenizer) into
a directory the caller names or a temporary one removed afterwards; a directory that already
holds a `transformers` model (config.json) is evaluated as it is.

Tasks are lm-eval's names (`hellaswag`, `arc_easy`, groups, tags, glob patterns) or tasks of
the caller's own yaml files in `include_path` — e.g. a multiple-choice task over a local jsonl
file (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`), which runs without network.
Every name is checked before anything is exported or loaded: an unknown one is an error that
names it and lm-eval's closest task names. Indexing lm-eval's ~14,000 bundled task files takes
about 10 s; when every task asked for is in `include_path`, only that directory is indexed.
"""
from __future__ import annotations

import difflib
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

from megalite.checkpoint.export import export_hf
from megalite.checkpoint.resolve import find_checkpoint
from megalite.utils.extras import install_hint, missing


class EvaluateError(ValueError):
    """Bad input to an evaluation; the message names it and what would work."""


def require_lm_eval():
    """The lm_eval module, or an error naming what is missing (lm-eval, or accelerate, which
    its `hf` model needs) and the command that installs the eval extra."""
    lacking = missing("lm_eval", "accelerate")
    if lacking:
        raise EvaluateError(f"{' and '.join(lacking)} not installed: megalite-evaluate needs "
                            f"the eval extra: {install_hint('eval')}")
    import lm_eval

    return lm_eval


def check_model_path(path) -> Path:
    """`path` if it is a transformers directory (config.json) or names a megalite checkpoint
    (a step_N directory, or a checkpoint.dir with a complete one)."""
    path = Path(path)
    if (path / "config.json").is_file() or find_checkpoint(path) is not None:
        return path
    raise EvaluateError(f"{path}: neither a transformers directory (no config.json) nor a "
                        "megalite checkpoint (a step_N directory holding meta.json, or a "
                        "checkpoint.dir with a complete one)")


def task_manager(tasks: List[str], include_path: Optional[str] = None):
    """An lm-eval TaskManager that knows every name in `tasks`; an unknown name is an
    EvaluateError naming it and the closest known names."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise EvaluateError(f"--include-path {include_path}: not a directory of task yaml "
                                "files")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise EvaluateError("; ".join(
            f"--tasks {t!r}: no such lm-eval task, group or tag"
            f"{' in lm-eval or ' + include_path if include_path else ''} (closest: "
            f"{', '.join(difflib.get_close_matches(t, manager.all_tasks, n=5)) or 'none'})"
            for t in unknown) + "; `lm-eval ls tasks` lists them, and --include-path DIR adds "
            "your own task yaml files")
    return manager


@contextmanager
def hf_model_dir(path: Path, export_dir: Optional[str] = None,
                 tokenizer: Optional[str] = None) -> Iterator[Path]:
    """A transformers directory for `path` (checked by `check_model_path`): itself, or the
    checkpoint exported into `export_dir` (kept) or a temporary directory (removed after)."""
    if (path / "config.json").is_file():
        yield path
        return
    if export_dir is not None:
        export_hf(path, export_dir, tokenizer)
        yield Path(export_dir)
        return
    tmp = Path(tempfile.mkdtemp(prefix="megalite-eval-"))
    try:
        export_hf(path, tmp / "hf", tokenizer)
        yield tmp / "hf"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def evaluate(model_dir: Path, tasks: List[str], manager, *, device: str, batch_size=1,
             num_fewshot: Optional[int] = None, limit: Optional[float] = None,
             dtype: str = "auto", log_samples: bool = False, seed: int = 0) -> dict:
    """lm-eval's results for `tasks` on the transformers model in `model_dir`."""
    lm_eval = require_lm_eval()
    return lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(model_dir), "device": device, "dtype": dtype},
        tasks=tasks, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
        batch_size=batch_size, log_samples=log_samples, random_seed=seed,
        numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
