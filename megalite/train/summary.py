"""What a finished run says: what happened and what to do next (rank 0, end of megalite-pretrain).

    run finished: 60 of train.max_steps=60 steps, 30,720 tokens
      train loss   5.6114 (step 60)
      val loss     5.7321 (step 60)
      ...
    next:
      megalite-generate <checkpoint> --prompt "The" --max-new-tokens 64
      ...

The figures come from the records this launch wrote (`Trainer.fit`'s return value, the same
lines as metrics.jsonl): the last train loss, the last validation loss and HellaSwag scores
(when the run evaluates them), and the mean MFU over this launch's metrics lines (each line
is one interval of log.every steps, so the mean is per interval, not weighted by time). Steps
and tokens are the run's totals, a resumed run's included.

Every command under "next:" works after the quickstart's install (`pip install -e .`), or says
what it needs: megalite-plot (matplotlib) and megalite-evaluate (lm-eval, accelerate) need the
`eval` extra, and when this environment lacks it their lines end in a comment naming the
command that installs it (`megalite.utils.extras.install_hint`).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from megalite.checkpoint.resolve import latest_checkpoint
from megalite.train.metrics_file import METRICS_FILE, metric
from megalite.utils.extras import install_hint, missing


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    max_steps: int
    tokens: int
    train_loss: Optional[float]
    val_loss: Optional[float]
    hellaswag_acc: Optional[float]
    hellaswag_acc_norm: Optional[float]
    mean_mfu: Optional[float]
    mfu_lines: int  # metrics lines the mean MFU is taken over
    last_step: dict  # metric -> the step of its last value
    checkpoint: Optional[Path]
    wandb: Optional[str]  # where the wandb run is: its URL or directory; None without wandb
    wandb_sync: Optional[str] = None  # the command that uploads an offline wandb run


def last_value(records: List[dict], name: str):
    """(value, step) of the last record holding metric `name`, or (None, None)."""
    for record in reversed(records):
        value = metric(record, name)
        if value is not None:
            return value, record["step"]
    return None, None


def summarize(records: List[dict], *, steps: int, max_steps: int, tokens: int, run_dir,
              checkpoint: Optional[Path], wandb: Optional[str],
              wandb_sync: Optional[str] = None) -> RunSummary:
    """The summary of a run whose launch wrote `records` and ended at step `steps` with
    `tokens` tokens consumed; `wandb`, `wandb_sync` as `wandb_location` gives them."""
    values, last_step = {}, {}
    for name in ("loss", "val_loss", "hellaswag_acc", "hellaswag_acc_norm"):
        values[name], last_step[name] = last_value(records, name)
    mfus = [m for m in (metric(r, "mfu") for r in records) if m is not None]
    return RunSummary(
        run_dir=Path(run_dir), steps=steps, max_steps=max_steps, tokens=tokens,
        train_loss=values["loss"], val_loss=values["val_loss"],
        hellaswag_acc=values["hellaswag_acc"], hellaswag_acc_norm=values["hellaswag_acc_norm"],
        mean_mfu=sum(mfus) / len(mfus) if mfus else None, mfu_lines=len(mfus),
        checkpoint=checkpoint, wandb=wandb, wandb_sync=wandb_sync, last_step=last_step)


def wandb_location(run) -> Tuple[Optional[str], Optional[str]]:
    """(where a finished wandb run is, the command that uploads it): online its URL and
    nothing to upload; offline its directory and `wandb sync DIR`; (None, None) without one."""
    if run is None:
        return None, None
    if not run.offline:
        return run.url, None
    sync_dir = Path(run.settings.sync_dir).resolve()
    return f"{sync_dir} (offline)", f"wandb sync {shlex.quote(str(sync_dir))}"


def _figure(label: str, value: Optional[float], step: Optional[int], missing: str) -> str:
    shown = f"{value:.4f} (step {step})" if value is not None else missing
    return f"  {label:<12} {shown}"


def render(s: RunSummary) -> str:
    """The summary as the lines rank 0 logs."""
    stopped = "" if s.steps >= s.max_steps else \
        " (stopped early; continue with checkpoint.resume=auto)"
    lines = [f"run finished: {s.steps} of train.max_steps={s.max_steps} steps, "
             f"{s.tokens:,} tokens{stopped}",
             _figure("train loss", s.train_loss, s.last_step["loss"], "none logged"),
             _figure("val loss", s.val_loss, s.last_step["val_loss"],
                     "not evaluated (train.eval_every=0)")]
    if s.hellaswag_acc is not None:
        norm = "" if s.hellaswag_acc_norm is None else f", acc_norm {s.hellaswag_acc_norm:.4f}"
        lines.append(f"  {'HellaSwag':<12} acc {s.hellaswag_acc:.4f}{norm} "
                     f"(step {s.last_step['hellaswag_acc']})")
    mfu = f"{s.mean_mfu:.2%} (mean of {s.mfu_lines} metrics lines)" if s.mean_mfu is not None \
        else "not measured (no peak FLOP/s for this device: set log.peak_tflops)"
    lines += [f"  {'mean MFU':<12} {mfu}",
              f"  {'metrics':<12} {s.run_dir / METRICS_FILE}",
              f"  {'wandb':<12} {s.wandb or 'off (log.wandb=false)'}",
              f"  {'checkpoint':<12} {s.checkpoint or 'none written'}",
              "next:"]
    lines += [f"  {command}" for command in next_commands(s)]
    return "\n".join(lines)


def next_commands(s: RunSummary) -> List[str]:
    """Generate from, export, plot and evaluate the run, with its paths filled in; a command
    that needs what this environment lacks (the eval extra) says what to install."""
    run = shlex.quote(str(s.run_dir))
    plot = f"megalite-plot {run} --out {shlex.quote(str(s.run_dir / 'metrics.png'))}" + \
        _needs(missing("matplotlib"))
    sync = [f"{s.wandb_sync}   # upload the offline wandb run"] if s.wandb_sync else []
    if s.checkpoint is None:
        return [plot] + sync
    ckpt = shlex.quote(str(s.checkpoint))
    lacking = missing("lm_eval", "accelerate")
    evaluate = f"megalite-evaluate {ckpt} --tasks hellaswag" + (
        _needs(lacking, "; lm-eval downloads the task's data") if lacking
        else "   # lm-eval downloads the task's data")
    return [f"megalite-generate {ckpt} --prompt \"The\" --max-new-tokens 64",
            f"megalite-export {ckpt} {shlex.quote(str(s.run_dir / 'hf'))}",
            plot, evaluate] + sync


def _needs(lacking: List[str], more: str = "") -> str:
    """The comment after a command whose modules `lacking` are not installed ('' if none)."""
    if not lacking:
        return ""
    return f"   # needs {' and '.join(lacking)}: {install_hint('eval')}{more}"


def trainer_summary(trainer, records: List[dict]) -> str:
    """The rendered summary of a Trainer whose `fit()` returned `records` (rank 0: it holds
    the metrics writer)."""
    writer = trainer.writer
    wandb, sync = wandb_location(writer.wandb_run if writer is not None else None)
    s = summarize(records, steps=trainer.step, max_steps=trainer.cfg.train.max_steps,
                  tokens=trainer.sampler.consumed_samples * trainer.cfg.train.seq_len,
                  run_dir=trainer.run_dir, checkpoint=latest_checkpoint(trainer.ckpt_root),
                  wandb=wandb, wandb_sync=sync)
    return render(s)
