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

A hub task downloads its data with `datasets` (the Hugging Face cache first). Where the Hub
cannot be reached, `offline_if_unreachable` (the command calls it before importing lm-eval)
sets HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, so the data comes from the cache or fails at
once instead of after about a minute of retries; a task whose data cannot be loaded is a
`TaskDataError` naming the task, its dataset and how to give it a local copy.
"""
from __future__ import annotations

import difflib
import os
import shutil
import tempfile
import traceback
import urllib.error
import urllib.request
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


HUB = "https://huggingface.co"  # HF_ENDPOINT overrides it, as for huggingface_hub
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_unreachable(timeout: float = 5.0) -> Optional[str]:
    """Why the Hugging Face Hub (HF_ENDPOINT, default huggingface.co) cannot be reached from
    here, or None when it answers (with any HTTP status). One request, no retries; a proxy
    in the environment (HTTPS_PROXY) is used as urllib uses it."""
    endpoint = os.environ.get("HF_ENDPOINT") or HUB
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as e:  # URLError, a timeout, a refused connection
        return f"{endpoint}: {getattr(e, 'reason', None) or e}"
    return None


def offline_if_unreachable() -> Optional[str]:
    """When the Hub cannot be reached, set HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 in this
    process's environment and return why; None (and nothing set) when it answers or when
    either variable is set already (the caller's choice stands). huggingface_hub and datasets
    read the variables when they are imported: call it before lm-eval is imported."""
    if any(name in os.environ for name in OFFLINE_VARIABLES):
        return None
    reason = hub_unreachable()
    if reason is not None:
        for name in OFFLINE_VARIABLES:
            os.environ[name] = "1"
    return reason


class TaskDataError(EvaluateError):
    """An lm-eval task's data could not be loaded: one line naming the task, its dataset, why,
    and (for data from the Hub) how to give megalite-evaluate a local copy."""

    def __init__(self, task: str, path: Optional[str], name: Optional[str], cause: BaseException,
                 offline_because: Optional[str] = None) -> None:
        self.task, self.path, self.name, self.cause = task, path, name, cause
        dataset = f"the dataset {path}" + (f" ({name})" if name else "")
        why = " ".join(f"{type(cause).__name__}: {cause}".split())
        if len(why) > 300:
            why = why[:297] + "..."
        if offline_because:
            why += f"; the Hub did not answer ({offline_because}), so this ran offline"
        fetch = _is_connection_failure(cause)
        text = (f"task {task}: its data, {dataset}, could not be "
                f"{'fetched' if fetch else 'loaded'} ({why})")
        if fetch:
            text += (f"; give it a local copy: a task yaml of your own in --include-path DIR "
                     f"(dataset_path: json, dataset_kwargs: {{data_files: ...}}), or a "
                     f"Hugging Face datasets cache holding {path} (HF_HOME=DIR) with "
                     f"HF_DATASETS_OFFLINE=1")
        super().__init__(text)


# exceptions (by class name, from huggingface_hub, httpx, requests) that mean the data's host
# could not be reached or offline mode forbade it, besides the builtin ConnectionError
_UNREACHABLE = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError",
                "ConnectTimeout", "ReadTimeout", "Timeout", "ProxyError"}


def _is_connection_failure(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, TimeoutError)) or \
                type(error).__name__ in _UNREACHABLE:
            return True
        error = error.__cause__ or error.__context__
    return False


def failed_task_data(error: BaseException):
    """(task name, dataset path, dataset name) of the lm-eval task whose data loading raised
    `error` (the frame of its `download`, where lm-eval calls datasets.load_dataset), or
    None when the error did not come from there."""
    from lm_eval.api.task import Task

    for frame, _ in traceback.walk_tb(error.__traceback__):
        task = frame.f_locals.get("self")
        if frame.f_code.co_name == "download" and isinstance(task, Task):
            config = getattr(task, "config", None)
            return (getattr(config, "task", None) or type(task).__name__,
                    getattr(task, "DATASET_PATH", None), getattr(task, "DATASET_NAME", None))
    return None


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
             dtype: str = "auto", log_samples: bool = False, seed: int = 0,
             offline_because: Optional[str] = None) -> dict:
    """lm-eval's results for `tasks` on the transformers model in `model_dir`; a task whose
    data cannot be loaded is a TaskDataError (`offline_because`: why the Hub was found
    unreachable, `offline_if_unreachable`'s answer, for its message)."""
    lm_eval = require_lm_eval()
    try:
        return lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(model_dir), "device": device,
                                    "dtype": dtype},
            tasks=tasks, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
            batch_size=batch_size, log_samples=log_samples, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    except Exception as e:
        failed = failed_task_data(e)
        if failed is None:
            raise
        raise TaskDataError(*failed, cause=e, offline_because=offline_because) from e
