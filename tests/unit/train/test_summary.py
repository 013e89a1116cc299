"""The end-of-run summary (megalite.train.summary) from made-up records; a real run's summary is
checked in tests/integration/cli/test_pretrain.py."""
import importlib.machinery
import shlex
import sys
import types
from pathlib import Path

from megalite.train.summary import render, summarize
from megalite.utils import extras
from tests.unit.cli.test_cli import REPO

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
    assert lines[0] == "run finished: 25 of train.max_steps=25 steps, 12,800 tokens"
    assert "  train loss   6.0000 (step 25)" in lines
    assert "  val loss     6.5000 (step 20)" in lines  # the last evaluation, not the last line
    assert "  HellaSwag    acc 0.2500, acc_norm 0.3000 (step 20)" in lines
    assert "  mean MFU     30.00% (mean of 3 metrics lines)" in lines
    assert "  metrics      /runs/my run/metrics.jsonl" in lines
    assert "  wandb        https://wandb.ai/me/megalite/runs/abc" in lines
    ckpt = shlex.quote("/runs/my run/checkpoints/step_00000025")
    # the commands, less a comment saying what to install (tests below)
    commands = [c.split("#")[0].rstrip() for c in lines[lines.index("next:") + 1:]]
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


def importable(monkeypatch, *modules, present: bool):
    """Make `modules` importable (an empty stand-in module) or not (None in sys.modules, which
    `import` and `importlib.util.find_spec` both take as absent) for this test."""
    for name in modules:
        stand_in = None
        if present:
            stand_in = types.ModuleType(name)
            stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, stand_in)


def next_lines(text):
    return {c.split()[0]: c for c in text.split("next:\n")[1].splitlines()}


def test_without_the_eval_extra_plot_and_evaluate_say_what_to_install(monkeypatch):
    """After the quickstart's `pip install -e .` (no matplotlib, lm-eval, accelerate), run from
    the checkout: the two commands that need the eval extra name it and its install command."""
    importable(monkeypatch, "matplotlib", "lm_eval", "accelerate", present=False)
    monkeypatch.chdir(REPO)
    commands = next_lines(summary_text(RECORDS))
    assert commands["megalite-plot"].endswith('   # needs matplotlib: pip install -e ".[eval]"')
    assert commands["megalite-evaluate"].endswith(
        '   # needs lm-eval and accelerate: pip install -e ".[eval]"; lm-eval downloads the '
        "task's data")
    for name in ("megalite-generate", "megalite-export"):
        assert "#" not in commands[name]  # the base install runs them
    assert shlex.split(commands["megalite-plot"].split("#")[0]) == [
        "megalite-plot", "/runs/my run", "--out", "/runs/my run/metrics.png"]
    assert shlex.split(commands["megalite-evaluate"].split("#")[0]) == [
        "megalite-evaluate", "/runs/my run/checkpoints/step_00000025", "--tasks", "hellaswag"]
    # run from elsewhere, the hint names the checkout
    monkeypatch.chdir("/")
    hinted = next_lines(summary_text(RECORDS, checkpoint=None))["megalite-plot"]
    assert hinted.endswith(f"# needs matplotlib: pip install -e {shlex.quote(f'{REPO}[eval]')}")


def test_with_the_eval_extra_plot_and_evaluate_are_plain_commands(monkeypatch):
    importable(monkeypatch, "matplotlib", "lm_eval", "accelerate", present=True)
    commands = next_lines(summary_text(RECORDS))
    assert shlex.split(commands["megalite-plot"]) == [
        "megalite-plot", "/runs/my run", "--out", "/runs/my run/metrics.png"]
    assert commands["megalite-evaluate"].endswith(
        "--tasks hellaswag   # lm-eval downloads the task's data")
    assert "needs" not in "\n".join(commands.values())
    importable(monkeypatch, "accelerate", present=False)  # one of the two is enough to say so
    evaluate = next_lines(summary_text(RECORDS))["megalite-evaluate"]
    assert "# needs accelerate: pip install -e" in evaluate


def test_an_installed_wheel_is_told_the_extras_packages_by_name(monkeypatch):
    """No checkout to `pip install -e` (the Docker image): the eval extra's requirements."""
    monkeypatch.setattr(extras, "checkout_root", lambda: None)
    hint = extras.install_hint("eval")
    assert hint.startswith("pip install ") and "-e" not in hint.split()
    assert all(name in hint for name in ("lm-eval", "accelerate", "matplotlib")), hint
