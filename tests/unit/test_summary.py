"""The end-of-run summary (megalite.train.summary) from made-up records; a real run's summary is
checked in tests/integration/test_pretrain.py."""
import shlex
from pathlib import Path

from megalite.train.summary import render, summarize

RECORDS = [
    {"step": 10, "loss": 7.5, "val_loss": None, "mfu": 0.20},
    {"step": 20, "loss": 6.25, "val_loss": 6.5, "mfu": 0.30,
     "val/hellaswag_acc": 0.25, "val/hellaswag_acc_norm": 0.3},
    {"step": 25, "loss": 6.0, "val_loss": None, "mfu": 0.40},
]


def summary_text(records, **kw):
    args = dict(steps=25, max_steps=25, tokens=12_800, run_dir=Path("/runs/my run"),
                checkpoint=Path("/runs/my run/checkpoints/step_00000025"),
                wandb="https://wandb.ai/me/megalite/runs/abc")
    return render(summarize(records, **{**args, **kw}))


def test_the_summary_gives_the_last_figures_the_mean_mfu_and_the_commands():
    text = summary_text(RECORDS)
    lines = text.splitlines()
    assert lines[0] == "megalite: run finished: 25 of train.max_steps=25 steps, 12,800 tokens"
    assert "  train loss   6.0000 (step 25)" in lines
    assert "  val loss     6.5000 (step 20)" in lines  # the last evaluation, not the last line
    assert "  HellaSwag    acc 0.2500, acc_norm 0.3000 (step 20)" in lines
    assert "  mean MFU     30.00% (mean of 3 metrics lines)" in lines
    assert "  metrics      /runs/my run/metrics.jsonl" in lines
    assert "  wandb        https://wandb.ai/me/megalite/runs/abc" in lines
    ckpt = shlex.quote("/runs/my run/checkpoints/step_00000025")
    commands = lines[lines.index("next:") + 1:]
    assert [c.split()[0] for c in commands] == ["megalite-generate", "megalite-export",
                                                "megalite-plot", "megalite-evaluate"]
    assert shlex.split(commands[1]) == ["megalite-export", "/runs/my run/checkpoints/step_00000025",
                                        "/runs/my run/hf"]
    assert all(ckpt in c for c in (commands[0], commands[1], commands[3]))
    assert shlex.split(commands[2]) == ["megalite-plot", "/runs/my run", "--out",
                                        "/runs/my run/metrics.png"]


def test_what_a_run_did_not_measure_is_said_so():
    records = [{k: v for k, v in r.items() if "hellaswag" not in k} for r in RECORDS]
    for r in records:
        r.update(val_loss=None, mfu=None)
    text = summary_text(records, steps=20, wandb=None, checkpoint=None)
    assert "stopped early; continue with checkpoint.resume=auto" in text.splitlines()[0]
    assert "val loss     not evaluated (train.eval_every=0)" in text
    assert "HellaSwag" not in text
    assert "mean MFU     not measured" in text
    assert "wandb        off (log.wandb=false)" in text
    assert "checkpoint   none written" in text
    assert [c.split()[0] for c in text.split("next:\n")[1].splitlines()] == ["megalite-plot"]


def test_an_offline_wandb_run_comes_with_its_upload_command():
    text = summary_text(RECORDS, wandb="/runs/my run/wandb/offline-run-1 (offline)",
                        wandb_sync="wandb sync '/runs/my run/wandb/offline-run-1'")
    assert "  wandb        /runs/my run/wandb/offline-run-1 (offline)" in text.splitlines()
    last = text.splitlines()[-1]
    assert shlex.split(last.split("#")[0]) == ["wandb", "sync", "/runs/my run/wandb/offline-run-1"]
