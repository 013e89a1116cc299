"""End to end: scripts/pretrain.py in a subprocess, as a user runs it."""
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.cli import export
from tests.conftest import TINY
from tests.wandb_log import history

REPO = Path(__file__).resolve().parents[3]
HEADER_KEYS = {"layout", "model", "vocab_size", "parameters", "flops_per_token", "flops_formula",
               "peak_tflops_per_device", "peak_source"}
RECORD_KEYS = {"step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s",
               "tflops_per_device", "mfu", "step_time_s", "memory", "comm"}


def pretrain(run_dir, *overrides, nproc=1, expect_ok=True, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [str(REPO / "scripts" / "pretrain.py"), f"hydra.run.dir={run_dir}",
                      *TINY, *overrides]
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(run_dir):
    """(header, records) of the latest run segment: a resumed run appends a new header line."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, line in enumerate(lines) if "run" in line)
    return lines[last]["run"], lines[last + 1:]


@pytest.mark.distributed
def test_pretrain_loss_falls_metrics_complete_and_wandb_matches(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = pretrain(run, f"data.dir={tiny_data}", "train.max_steps=60", "train.eval_every=30",
                    "log.every=10", "log.wandb=offline", "optim.lr=3e-3", "optim.warmup_steps=5")
    header, records = read_metrics(run)
    check_end_of_run_summary(proc.stderr, run, records)
    assert HEADER_KEYS <= set(header)
    assert header["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "zero": 0, "sp": False,
                                "virtual_stages": 1, "world_size": 1, "ep": 1,
                                "rank_order": "tp-cp-pp-dp"}
    assert header["peak_source"].startswith("measured") and header["peak_tflops_per_device"] > 0
    (planned,) = header["plan"]["stages"]  # the plan's state bytes = what the engine holds
    (held,) = header["model_state_bytes"]
    for kind in ("params", "grads", "optimizer"):
        assert held[kind] == pytest.approx(planned["bytes"][kind], rel=1e-3)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    for r in records:
        assert RECORD_KEYS <= set(r), set(r) ^ RECORD_KEYS
        assert r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 and r["mfu"] > 0
    assert [r["step"] for r in records if r["val_loss"] is not None] == [30, 60]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert records[-1]["val_loss"] < records[0]["loss"]
    rows = {row["_step"]: row for row in history(run / "wandb")}
    for r in records:
        row = rows[r["step"]]
        assert row["train/loss"] == pytest.approx(r["loss"], rel=1e-12)
        assert row["train/lr"] == pytest.approx(r["lr"], rel=1e-12)
        assert row["perf/mfu"] == pytest.approx(r["mfu"], rel=1e-12)
        if r["val_loss"] is not None:
            assert row["val/loss"] == pytest.approx(r["val_loss"], rel=1e-12)
    assert (run / "checkpoints" / "step_00000060" / "meta.json").is_file()


def check_end_of_run_summary(stderr, run, records):
    """Rank 0's last message (megalite.train.summary): the run's figures as metrics.jsonl has
    them, where its files are, and next commands that work (the export one is run)."""
    marked = "[megalite][rank 0][INFO] - run finished:"  # the log format marks it megalite's
    summary = stderr[stderr.index(marked) + marked.index("run finished:"):].splitlines()
    assert (run / "pretrain.log").read_text().count(marked) == 1
    mfus = [r["mfu"] for r in records]
    ckpt = run / "checkpoints" / "step_00000060"
    assert summary[0] == (f"run finished: 60 of train.max_steps=60 steps, "
                          f"{records[-1]['consumed_tokens']:,} tokens")
    figures = dict(line.strip().split(maxsplit=1) for line in summary[1:summary.index("next:")])
    assert figures["train"] == f"loss   {records[-1]['loss']:.4f} (step 60)"
    assert figures["val"] == f"loss     {records[-1]['val_loss']:.4f} (step 60)"
    assert figures["mean"] == f"MFU     {sum(mfus) / len(mfus):.2%} (mean of 6 metrics lines)"
    assert figures["metrics"] == str(run / "metrics.jsonl")
    assert figures["checkpoint"] == str(ckpt)
    wandb_dir = Path(figures["wandb"].removesuffix(" (offline)"))
    assert wandb_dir.parent == run / "wandb" and wandb_dir.is_dir(), figures["wandb"]
    commands = {c.split()[0]: shlex.split(c.split("#")[0]) for c in
                summary[summary.index("next:") + 1:]}
    assert set(commands) == {"megalite-generate", "megalite-export", "megalite-plot",
                             "megalite-evaluate", "wandb"}
    assert commands["wandb"] == ["wandb", "sync", str(wandb_dir)]
    assert commands["megalite-export"] == ["megalite-export", str(ckpt), str(run / "hf")]
    export.main(commands["megalite-export"][1:])
    assert (run / "hf" / "model.safetensors").is_file()


@pytest.mark.distributed
def test_resume_continues_the_same_loss_curve(tiny_data, tmp_path):
    common = [f"data.dir={tiny_data}", "train.max_steps=12", "train.eval_every=0", "log.every=1",
              "log.wandb=false", "model.resid_pdrop=0.1", "model.attn_pdrop=0.1",
              "model.embd_pdrop=0.1", "precision=fp32"]
    full = tmp_path / "full"
    pretrain(full, *common, "checkpoint.every=6")
    _, straight = read_metrics(full)
    resumed_dir = tmp_path / "resumed"
    pretrain(resumed_dir, *common, f"checkpoint.dir={full / 'checkpoints'}", "checkpoint.resume=auto")
    _, resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == []  # latest complete checkpoint is step 12: nothing left
    proc = pretrain(resumed_dir, *common,
                    f"checkpoint.resume={full / 'checkpoints' / 'step_00000006'}")
    said = "step_00000006 at step 6"  # megalite.utils.log: once on stderr, once in rank 0's log
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert (resumed_dir / "pretrain.log").read_text().count(said) == 1
    header, resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(7, 13))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[6:]]  # bit-exact (fp32 CPU)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[6:]]


@pytest.mark.distributed
def test_two_ranks_under_torchrun_equal_one(tiny_data, tmp_path):
    common = [f"data.dir={tiny_data}", "train.max_steps=5", "train.eval_every=0", "log.every=1",
              "log.wandb=false", "precision=fp32"]
    pretrain(tmp_path / "one", *common)
    two_ranks = pretrain(tmp_path / "two", *common, nproc=2)
    assert "[rank 0]" in two_ranks.stderr and "[rank 1]" not in two_ranks.stderr  # log.all_ranks
    _, one = read_metrics(tmp_path / "one")
    header, two = read_metrics(tmp_path / "two")
    assert header["layout"]["dp"] == 2
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # per step: one fp32 all-reduce of every gradient (169,728 parameters: no padding for dp=2);
    # the averages of logged metrics are not training traffic and are not counted
    for record in two:
        assert record["comm"]["dp/all_reduce"]["bytes"] == header["parameters"] * 4
    assert "dp/all_reduce" not in one[0]["comm"]


@pytest.mark.distributed
@pytest.mark.parametrize("overrides,needle", [
    (["model=gpt5"], "model='gpt5': no such preset; use one of gpt2, gpt2-large"),
    (["train.seq_len=100"], "train.seq_len=100"),
    (["train.global_batch_size=10"], "train.global_batch_size=10"),
    (["model.vocab_size=512"], "model.vocab_size=512"),
    (["data.dir=/nonexistent/shards"], "data.dir"),
    (["train.global_batch_size=8000000"], "train.global_batch_size=8000000: the training split"),
    (["init_from=/nonexistent/gpt2"], "init_from='/nonexistent/gpt2': no such file or directory"),
    (["optim.lr=-1"], "optim.lr=-1.0"),
])
def test_bad_input_fails_before_anything_is_written(tiny_data, tmp_path, overrides, needle):
    """Refused before any process group or file exists: exit status 2 and the key named."""
    run = tmp_path / "run"
    proc = pretrain(run, f"data.dir={tiny_data}", *overrides, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr, proc.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.distributed
def test_pipeline_run_reports_its_bubble_and_dumps_the_schedule(tiny_data, tmp_path):
    run = tmp_path / "run"
    pretrain(run, f"data.dir={tiny_data}", "pp=2", "train.micro_batch_size=4",
             "train.global_batch_size=16", "train.max_steps=2", "train.eval_every=0",
             "log.every=1", "log.wandb=false", "log.pipeline_trace=true", nproc=2)
    header, records = read_metrics(run)
    assert header["stages"] == [[[0, 1]], [[1, 2]]] and header["micro_batches"] == 4
    for r in records:
        assert 0.0 <= r["pipeline_bubble"] < 1.0
        assert r["pipeline_bubble_expected"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    for rank in range(2):
        events = json.loads((run / "pipeline_trace" / f"rank{rank:05d}.json").read_text())
        names = [e["name"] for e in events["traceEvents"]]
        assert sorted(names) == sorted([f"F{i}" for i in range(4)] + [f"B{i}" for i in range(4)])
        assert all(e["tid"] == rank for e in events["traceEvents"])  # one row per stage


@pytest.mark.distributed
def test_init_from_a_transformers_directory_takes_its_model(tiny_data, tmp_path):
    """`megalite-pretrain init_from=<a Qwen3-MoE directory>`: the family, head size and
    experts come from config.json (the command line gives TINY's keys, which agree); a key that
    disagrees is refused by name before anything is written."""
    from megalite.config.model import ModelConfig
    from megalite.config.moe import MoEConfig
    from tests.unit.model.test_qwen3 import random_hf

    shape = ModelConfig(arch="qwen3_moe", n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                        head_dim=24, n_positions=64, vocab_size=1024, n_inner=48,
                        tie_word_embeddings=False,
                        moe=MoEConfig(num_experts=4, top_k=2, expert_size=16))
    hf = random_hf(shape)
    hf.save_pretrained(tmp_path / "qwen3-moe")
    common = [f"data.dir={tiny_data}", f"init_from={tmp_path / 'qwen3-moe'}", "log.wandb=false",
              "precision=fp32", "train.eval_every=0"]
    refused = pretrain(tmp_path / "bad", *common, "model.n_layer=3", expect_ok=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "model.n_layer=3: init_from=" in refused.stderr and "has 2 (config.json)" \
        in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    pretrain(tmp_path / "run", *common, "train.max_steps=1", "log.every=1")
    header, records = read_metrics(tmp_path / "run")
    assert header["model"]["arch"] == "qwen3_moe"
    assert header["parameters"] == hf.num_parameters()
    assert len(records) == 1 and math.isfinite(records[0]["loss"])
