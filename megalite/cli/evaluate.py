"""Evaluate a run's model with EleutherAI's lm-eval harness (the `transformers` export, model `hf`).

    megalite-evaluate outputs/run/checkpoints --tasks hellaswag,arc_easy      # latest checkpoint
    megalite-evaluate exported/gpt2-run --tasks hellaswag --limit 1000 --batch-size 32
    megalite-evaluate CKPT --tasks my_task --include-path my_tasks/          # local yaml tasks

(`python scripts/evaluate.py ...` in a checkout is the same command.) A checkpoint (a step_N
directory, or a checkpoint.dir for its latest) is exported to `transformers` first — into
--export-dir, kept, or a temporary directory — as `megalite-export` does; a directory holding
config.json is evaluated as it is. The task names are checked before anything is exported: an
unknown one exits with status 2 naming it and lm-eval's closest names. Hub tasks download
their datasets (the Hugging Face cache first); a task of your own (--include-path: yaml files
with `dataset_path: json` and `dataset_kwargs: {data_files: ...}`) runs offline. Where the Hub
does not answer, the command runs offline (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, unless
either is set): a hub task's data then comes from the cache (HF_HOME) or the command exits
with status 2 at once, naming the task and its dataset. Prints lm-eval's
table; --output writes its results as JSON (--log-samples: with every example's scores).
Needs the `eval` extra (lm-eval, accelerate): pip install -e ".[eval]" in a checkout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.resolve import CheckpointNotFound
from megalite.eval.lm_harness import (
    EvaluateError,
    check_model_path,
    evaluate,
    hf_model_dir,
    offline_if_unreachable,
    require_lm_eval,
    task_manager,
)
from megalite.utils.device import default_device


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a checkpoint step_N, a checkpoint.dir (its latest), or "
                        "a transformers directory (megalite-export's output)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task, group or tag names (or globs)")
    parser.add_argument("--include-path", help="a directory of your own task yaml files")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task (a fraction if < 1); for a quick look only")
    parser.add_argument("--batch-size", default="1", help="an integer, or 'auto'")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", help="model dtype for lm-eval's hf model "
                        "(auto: the export's, float32)")
    parser.add_argument("--export-dir", help="keep the export of a checkpoint here (default: "
                        "a temporary directory, removed afterwards)")
    parser.add_argument("--tokenizer", help="tokenizer directory for the export (default: the "
                        "checkpoint's <data.dir>/tokenizer)")
    parser.add_argument("--output", type=Path, help="write lm-eval's results here as JSON")
    parser.add_argument("--log-samples", action="store_true",
                        help="with --output: include every example's inputs and scores")
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's random seeds")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Check everything, then export (if a checkpoint) and evaluate; lm-eval's results."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise EvaluateError(f"--tasks {args.tasks!r}: no task names (e.g. --tasks hellaswag)")
    batch_size = args.batch_size if args.batch_size == "auto" else _positive(args.batch_size)
    path = check_model_path(args.model)
    export_dir = Path(args.export_dir) if args.export_dir else None
    if export_dir is not None and export_dir.exists() and (
            not export_dir.is_dir() or any(export_dir.iterdir())):
        raise EvaluateError(f"--export-dir {export_dir}: exists and is not an empty directory; "
                            "name a new one (or leave it out for a temporary export)")
    require_lm_eval()
    offline_because = offline_if_unreachable()  # before lm-eval imports huggingface_hub
    manager = task_manager(tasks, args.include_path)
    device = args.device or default_device()
    with hf_model_dir(path, args.export_dir, args.tokenizer) as model_dir:
        results = evaluate(model_dir, tasks, manager, device=device, batch_size=batch_size,
                           num_fewshot=args.num_fewshot, limit=args.limit, dtype=args.dtype,
                           log_samples=args.log_samples, seed=args.seed,
                           offline_because=offline_because)
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        print(f"wrote {args.output}")
    return results


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise EvaluateError(f"--batch-size {text!r}: a positive integer or 'auto'")
    return int(text)


def main(argv: Optional[List[str]] = None) -> None:
    """`megalite-evaluate MODEL --tasks T1,T2`; argv defaults to the command line."""
    args = parse_args(argv)
    try:
        run(args)
    except (EvaluateError, CheckpointError, CheckpointNotFound) as e:
        print(f"megalite: cannot evaluate: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
