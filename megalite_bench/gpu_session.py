"""One `megalite-bench gpu` session: its budget, the report, the corpus, and the two ways a
part runs something (a command under the budget; `pretrain.py` under torchrun, stopped once its
timed records are in); and what the planner says of a run (its plan's peak, the table's step)."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megalite_bench.gpu_report import Part, Report, machine_header
from megalite_bench.gpu_runs import Ran, read_metrics, run_command, summarize_launch
from megalite_bench.gpu_sizes import FULL, REDUCED


class GpuSession:
    def __init__(self, args):
        self.args = args
        self.sizes = REDUCED if args.reduced else FULL
        self.python = sys.executable
        self.deadline = time.monotonic() + args.budget_s
        self.out = Path(args.out).resolve()
        self.report = Report(self.out, machine_header(args.reduced, args.budget_s,
                                                      self.python))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
        self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as measured
        self.report.header["PYTORCH_CUDA_ALLOC_CONF"] = self.env["PYTORCH_CUDA_ALLOC_CONF"]
        self.repo = checkout()
        self.data: Optional[Path] = Path(args.data).resolve() if args.data else None
        self.measured: Dict[str, dict] = {}  # mfu rows by id (what calibrate predicts)
        self.table = table_profile(self.report.header.get("gpu"), args.reduced)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, part: Part, name: str, cmd: List[str], limit: float, **kw) -> Ran:
        """`cmd` under min(limit, the budget left); logged to DIR/logs/<name>.log."""
        limit = min(limit, self.remaining())
        part.commands.append(" ".join(map(str, cmd)))
        if limit < 5:
            return Ran(None, 0.0, "not started: the budget ran out", cut=True)
        return run_command(cmd, limit, cwd=kw.pop("cwd", self.out), env=self.env,
                           log=self.out / "logs" / f"{slug(name)}.log", **kw)

    def ensure_data(self, part: Part) -> Optional[Path]:
        if self.data is None:
            self.data = (self.out / "data" / "stdlib-reduced") if self.args.reduced else \
                (Path.cwd() / "data" / "stdlib").resolve()
        if (self.data / "meta.json").is_file():
            return self.data
        extra = ["data.max_documents=150", "data.tokenizer_vocab_size=1024",
                 "data.num_proc=1"] if self.args.reduced else []
        ran = self.run(part, "prepare", [self.python, "-m", "megalite.cli.prepare",
                                         f"data.dir={self.data}", *extra],
                       self.sizes.limits["prepare"])
        if not (self.data / "meta.json").is_file():
            part.notes.append(f"no corpus at {self.data}: {ran.status()}\n{ran.tail()}")
            return None
        part.notes.append(f"prepared {self.data} in {ran.seconds:.0f} s")
        return self.data

    def launch(self, part: Part, name: str, overrides: List[str], limit: float,
                timed: bool = True) -> Tuple[Ran, dict]:
        """pretrain.py under torchrun, one rank; stopped once its timed records are in."""
        s = self.sizes
        run_dir = self.out / "runs" / slug(name)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        steps = s.launch_skip + s.launch_steps
        metrics = run_dir / "metrics.jsonl"
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", "-m", "megalite.cli.pretrain", f"hydra.run.dir={run_dir}",
               f"data.dir={self.data}", *overrides, "log.wandb=false", "log.progress=false",
               "train.eval_every=0", "log.every=1"]
        if timed:  # never reached: the run is stopped once its records are in, before the
            cmd.append(f"train.max_steps={steps + 20}")  # final checkpoint of its last step
        ran = self.run(part, name, cmd, limit,
                       stop_when=(lambda: len(read_metrics(metrics)[1]) >= steps)
                       if timed else None)
        header, records = read_metrics(metrics)
        summary = summarize_launch(header, records, s.launch_skip, s.launch_steps)
        return ran, {**summary, "records": records}


def planned(overrides: List[str], profile, reduced: bool) -> Tuple[Optional[float],
                                                                    Optional[float]]:
    """(the plan's peak bytes, the predicted step on `profile`) of a one-rank run."""
    try:
        from megalite.config.layout import Layout
        from megalite.plan.memory import make_plan
        from megalite.plan.time_model import predict
        from megalite.train.preflight import validated_config

        device = "cpu" if reduced else "cuda"
        cfg, _ = validated_config(list(overrides), 1, 1, device)
        layout = Layout.from_config(cfg, 1, device, True)
        plan = make_plan(cfg, layout)
        peak = max(st.bytes["total"] for st in plan.stages)
        step = predict(cfg, layout, plan.stages, profile, 1).step_s if profile else None
        return peak, step
    except Exception:  # a figure for the report, never a reason to stop
        return None, None


def table_profile(gpu: Optional[str], reduced: bool):
    from megalite.plan.devices import device_profile, table_entry_for

    if reduced or not gpu:
        return device_profile("cpu") if reduced else None
    return table_entry_for(gpu)


def checkout() -> Optional[Path]:
    """The checkout holding tests/ (the working directory's, else this package's)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / "tests" / "unit").is_dir():
            return root
    return None


def slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())
