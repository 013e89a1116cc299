"""The side-by-side harness of the resilience benchmarks (`bench resilience`, `rerun`,
`flight`): per layout one trainer in a gloo world of `--world` ranks, on the real training
path, runs steps with a feature on and off in turn (on, off, off, on, ...: `is_on`), so that
the drift of a shared machine hits both arms alike; results from rank 0.

    add_arguments(parser, ...)         the options every one of them takes
    run_layouts(args, extra, measure)  `measure(trainer, args, rank)` per layout, in spawned
                                       ranks, with the data prepared first if --data is unset
    describe(args)                     the run's shape, for the table's header

The data: `--data` (a prepared directory), or a small corpus of Python's standard library
prepared into a temporary directory first (150 files, a 1,024-token BPE: `prepared_corpus`).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, List

from megalite.testing.spawn import run_ranks

CHECKS_OFF = ["resilience.check_every=0", "resilience.straggler_report_every=0"]
Measure = Callable[[object, object, int], dict]  # (trainer, args, rank) -> results


def prepared_corpus(root: Path) -> Path:
    from megalite.config.schema import DataConfig
    from megalite.data.prepare import prepare

    out = root / "stdlib"
    prepare(DataConfig(dir=str(out), max_documents=150, tokenizer_vocab_size=1024,
                       val_fraction=0.05, num_proc=1), out, progress=False)
    return out


def is_on(n: int) -> bool:
    """Step n's arm: on, off, off, on, ... (every 4-step block has two of each, mirrored)."""
    return n % 4 in (0, 3)


def trainer_overrides(args, layout: List[str], data: str, run_dir: str,
                      extra: List[str]) -> List[str]:
    """A benchmark trainer: no evaluation, no logging services, `extra` (the resilience
    settings: `CHECKS_OFF` and the feature measured), and `layout` last."""
    return [f"model={args.preset}", *[f"model.{kv}" for kv in args.model], f"data.dir={data}",
            f"device={getattr(args, 'device', 'cpu')}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}", "train.max_steps=1000000",
            "train.eval_every=0", "log.wandb=false", "log.progress=false",
            "log.peak_tflops=1", f"checkpoint.dir={run_dir}/ckpt", *extra, *layout]


def _each_layout(rank: int, world: int, args, layouts: List[List[str]], data: str, root: str,
                 extra: List[str], measure: Measure) -> List[dict]:
    from megalite.config.schema import load_config
    from megalite.train.launch import launch

    results = []
    for i, layout in enumerate(layouts):
        cfg = load_config(trainer_overrides(args, layout, data, f"{root}/{i}", extra))
        trainer = launch(cfg, world, Path(root) / str(i)).trainer
        results.append({"layout": " ".join(layout), **measure(trainer, args, rank)})
    return results


def run_layouts(args, extra: List[str], measure: Measure) -> List[dict]:
    """Rank 0's `measure` of each of `args.layouts` (comma-separated overrides), the trainers
    configured by `trainer_overrides` with `extra`."""
    layouts = [s.split(",") for s in args.layouts]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(prepared_corpus(Path(tmp)))
        return run_ranks(_each_layout, args.world,
                         args=(args, layouts, data, tmp, extra, measure), timeout_s=3600)[0]


def describe(args) -> str:
    return (f"preset {args.preset} {' '.join(args.model)}, seq {args.seq_len}, micro-batch "
            f"{args.micro_batch}, global batch {args.global_batch}, {args.world} ranks on "
            f"{getattr(args, 'device', 'cpu')}")


def add_arguments(parser, layouts: List[str], seq_len: int, steps: int,
                  device: bool = True) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset (conf/model)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model overrides, e.g. n_layer=2")
    parser.add_argument("--layouts", nargs="+", default=layouts,
                        help="comma-separated overrides per layout, each on --world ranks")
    parser.add_argument("--world", type=int, default=2, help="ranks (a gloo world)")
    if device:
        parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data", default=None, help="a prepared data directory")
