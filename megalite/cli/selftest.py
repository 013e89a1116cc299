"""`megalite-selftest`: a day-one check of a cluster before a long job, the way nccl-tests is run
— on the user's nodes, drivers and file system, under the launcher the job will use:

    torchrun --standalone --nproc_per_node=8 --no-python megalite-selftest
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \\
        --no-python megalite-selftest checkpoint.dir=/shared/ckpt --report-dir selftest
    srun --ntasks-per-node=8 megalite-selftest checkpoint.dir=/shared/ckpt   # Slurm, no torchrun

(`python scripts/selftest.py ...` in a checkout is the same command.) For the world it is
started with it trains a tiny model a few steps under every layout class that fits (TP inside
a node with and without SP; PP with 1F1B, interleaved and ZB-H1; CP with the keys and values
all-gathered and in a ring; ZeRO 1 and 3 over DP; the combination), each against the serial
run computed on rank 0 of the same job (fp32 unless `precision=` says otherwise: rel 1e-5 as
the test suite's); saves a checkpoint under
`checkpoint.dir` (default: <report dir>/checkpoints) and resumes it under another layout;
measures the links the groups use (within and across nodes) against the device table;
exchanges rows over expert-parallel groups of up to 8 ranks as the MoE all-to-all dispatcher
does, the counts then the rows, every row received checked (`megalite.train.selftest_ep`;
off with the links under --no-links); and
writes `<report dir>/selftest.json` and `selftest.txt` (per check: pass / fail, the figure,
the tolerance). Exit status: 0 all passed, 1 a check failed, 2 bad input (refused by name
before any work: a world that fits none of the layouts asked for, an unwritable directory, a
bad override).

Arguments: overrides of the configuration (`KEY=VALUE`, e.g. `checkpoint.dir=...`,
`precision=bf16`, `parallel.timeout_s=...`), and `LAYOUT:KEY=VALUE` for one layout's run only,
e.g. a fault drill that shows the self-test catching a corrupted gradient:

    megalite-selftest zero1:resilience.inject=rank:1/step:2/target:grad \\
        zero1:resilience.allow_inject=true
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.cli.launch_env import export_launch_env, launch_env
from megalite.cli.refusal import record_error, say
from megalite.cli.selftest_plan import BadInput, Plan, make_plan
from megalite.config.errors import ConfigError
from megalite.config.schema import load_config
from megalite.plan import link_check
from megalite.train import selftest as st
from megalite.train import selftest_ep
from megalite.train.runtime import local_device, local_gpus, run_layout

REPORT_FORMAT = "megalite-selftest"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megalite-selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report-dir", default="selftest-report",
                        help="where selftest.json and selftest.txt go (rank 0 writes them)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per layout")
    parser.add_argument("--save-at", type=int, default=2,
                        help="the step checkpointed and resumed under another layout")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="NAME",
                        help="only these layout classes (default: every one that fits)")
    parser.add_argument("--no-links", action="store_true", help="skip the link check")
    parser.add_argument("--no-resume", action="store_true", help="skip the checkpoint check")
    parser.add_argument("overrides", nargs="*", metavar="[LAYOUT:]KEY=VALUE")
    return parser.parse_args(argv)


def _init_group(device: torch.device, timeout_s: float) -> bool:
    """The default process group of a launch, if launched and not yet made; whether it was
    made here (and is this command's to destroy)."""
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        return True
    return False


def _agree(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem, on every rank (None: none anywhere)."""
    if not dist.is_initialized():
        return problem
    gathered: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p is not None), None)


def run_checks(plan: Plan, device: torch.device, rank: int, work: Path) -> List[dict]:
    """Every check of `plan`, in order; the same list on every rank."""
    results = []
    steps, save_at = plan.args.steps, plan.args.save_at
    box = [st.run_serial(plan.serial, device, work / "serial", steps) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    serial = box[0]
    saved: Dict[str, Optional[str]] = {}
    for check in plan.checks:
        source = plan.resume is not None and plan.resume[0] == check.name
        out = st.timed(lambda: st.run_layout(plan.configs[check.name], plan.world,
                                             work / check.name, steps, serial, plan.tolerance,
                                             save_at=save_at if source else None))
        saved[check.name] = out.pop("saved")
        results.append(_layout_result(plan, check, out))
    if plan.resume is not None:
        results.append(_resume_result(plan, serial, saved, work))
    for link in plan.links:
        t0 = time.perf_counter()
        entries = link_check.measure_link(link, plan.per_node, device)
        judged = link_check.judge(link, entries, device, link_check.table_for(device))
        judged["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(_link_result(judged))
    if plan.links and selftest_ep.ep_size(plan.world, plan.per_node) > 1:  # --no-links: off
        results.append(selftest_ep.ep_exchange_check(plan.world, plan.per_node, device,
                                                     plan.base.parallel.timeout_s))
    return results


def _layout_result(plan: Plan, check: st.LayoutCheck, out: dict) -> dict:
    tol = plan.tolerance
    return {"name": f"layout {check.name}", "kind": "layout", "layout": check.describe(),
            "what": check.what, "passed": bool(out["figure"] <= tol.rel),
            "figure": out["figure"], "quantity": out["quantity"], "tolerance": tol.rel,
            "tolerance_rule": tol.what,
            "crosses_nodes": st.crossing_groups(check, plan.world, plan.per_node),
            "seconds": out["seconds"]}


def _resume_result(plan: Plan, serial: dict, saved: Dict[str, Optional[str]],
                   work: Path) -> dict:
    source, target = plan.resume
    steps, save_at = plan.args.steps, plan.args.save_at
    path = saved.get(source)
    name = f"checkpoint {source} -> {target or 'serial layout'}"
    if path is None:
        return {"name": name, "kind": "checkpoint", "passed": False, "figure": None,
                "quantity": f"no checkpoint was written by {source} at step {save_at}",
                "tolerance": plan.tolerance.rel, "seconds": 0.0}
    if target is None:
        cfg, check = st.configure(plan.serial, None), None
    else:
        cfg = plan.configs[target]
        check = next(c for c in plan.checks if c.name == target)
    cfg = st.with_settings(cfg, **{"checkpoint.resume": path, "resilience.inject": None})
    out = st.timed(lambda: st.run_layout(cfg, plan.world, work / "resume", steps - save_at,
                                         serial, plan.tolerance, first_step=save_at))
    return {"name": name, "kind": "checkpoint",
            "layout": check.describe() if check else "serial",
            "what": f"saved after step {save_at} to {path}, resumed under another layout, "
                    f"steps {save_at + 1}-{steps} against the serial run",
            "passed": bool(out["figure"] <= plan.tolerance.rel), "figure": out["figure"],
            "quantity": out["quantity"], "tolerance": plan.tolerance.rel,
            "tolerance_rule": plan.tolerance.what, "seconds": out["seconds"]}


def _link_result(j: dict) -> dict:
    table = j["table"]
    return {"name": f"link {j['link']}", "kind": "link", "passed": bool(j["passed"]),
            "figure": j["bus_gbps"], "unit": "GB/s bus bandwidth",
            "latency_s": j["latency_s"], "group_size": j["group_size"],
            "table": table, "ratio_to_table": j.get("ratio"),
            "tolerance": j.get("min_bus_gbps"),
            "tolerance_rule": j["rule"], "sweep": j["sweep"], "seconds": j["seconds"]}


def report_text(report: dict) -> str:
    """The text report: a header, one line per check, what was skipped."""
    verdict = "PASS" if report["passed"] else "FAIL"
    n_pass = sum(c["passed"] for c in report["checks"])
    lines = [f"megalite self-test: {report['world_size']} ranks ({report['nodes']} node(s) x "
             f"{report['ranks_per_node']}), {report['device']}, {report['precision']}, torch "
             f"{report['torch']}: {n_pass} of {len(report['checks'])} checks passed: {verdict}",
             f"{'check':<36} {'result':<6} {'figure':>11} {'tolerance':>11}  what"]
    for c in report["checks"]:
        result = "pass" if c["passed"] else "FAIL"
        if c["kind"] == "link":
            fig = f"{c['figure']:.3g} GB/s"
            tol = "-" if c["tolerance"] is None else f">= {c['tolerance']:.3g}"
            what = (f"bus bandwidth of groups of {c['group_size']}, latency "
                    f"{c['latency_s'] * 1e6:.3g} µs; {c['tolerance_rule']}")
            if c.get("ratio_to_table") is not None:
                what += f"; {c['ratio_to_table']:.2f}x the table's {c['table']['name']}"
        elif c["kind"] == "exchange":
            fig, tol = f"{c['figure']:g} rows", "0 wrong"
            what = f"ep {c['ep']}, groups {c['groups']}: {c['quantity']}; {c['tolerance_rule']}"
        else:
            fig = "-" if c["figure"] is None else f"{c['figure']:.2e}"
            tol = f"<= {c['tolerance']:.0e}"
            what = f"{c.get('layout', '')}: largest difference: {c['quantity']}"
            if c.get("crosses_nodes"):
                what += f"; groups across nodes: {', '.join(c['crosses_nodes'])}"
        lines.append(f"{c['name']:<36} {result:<6} {fig:>11} {tol:>11}  {what}")
    lines += [f"skipped: {s}" for s in report["skipped"]]
    lines.append(f"tolerance: {report['tolerance_rule']}; {report['seconds']:.1f} s")
    return "\n".join(lines)


def selftest(argv: Optional[Sequence[str]] = None) -> int:
    """The command; returns the exit status (0 passed, 1 a check failed, 2 bad input)."""
    args = parse_args(argv)
    try:
        export_launch_env(launch_env(gpus=local_gpus()))
    except ConfigError as e:
        say(f"megalite: bad launch: {e}")
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1" if world == 1 else str(world)))
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="megalite-selftest-"))
    try:
        return _selftest(args, world, rank, per_node, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _selftest(args, world: int, rank: int, per_node: int, work: Path, started: float) -> int:
    data = st.synthetic_data(work / "data", vocab=256)
    plan, problem = None, None
    try:
        plan = make_plan(args, world, per_node, rank, data)
        plan.args = args
    except (BadInput, ConfigError) as e:
        problem = str(e)
    base = plan.base if plan else load_config([*st.SELFTEST_MODEL, *st.SELFTEST_TRAIN])
    device = local_device(run_layout(base), int(os.environ.get("LOCAL_RANK", "0")))
    made = _init_group(device, base.parallel.timeout_s)
    try:
        return _checked(args, plan, _agree(problem), device, world, rank, per_node, work,
                        started)
    finally:
        if made:
            dist.destroy_process_group()


def _checked(args, plan: Optional[Plan], problem: Optional[str], device: torch.device,
             world: int, rank: int, per_node: int, work: Path, started: float) -> int:
    if problem is not None:  # the same on every rank (agreed): printed once, recorded by all
        record_error(f"megalite: selftest: {problem}")
        if rank == 0:
            print(f"megalite: selftest: {problem}", file=sys.stderr)
        return 2
    if rank == 0 and plan.checkpoint_root.exists():  # a previous self-test's checkpoints
        shutil.rmtree(plan.checkpoint_root, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    checks = run_checks(plan, device, rank, work)
    passed = all(c["passed"] for c in checks)
    report = {"format": REPORT_FORMAT, "version": 1, "passed": passed,
              "world_size": world, "ranks_per_node": per_node, "nodes": world // per_node,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "precision": plan.precision, "torch": torch.__version__,
              "steps": args.steps, "tolerance_rule": plan.tolerance.what,
              "skipped": plan.skipped, "checks": checks,
              "seconds": round(time.perf_counter() - started, 2)}
    if rank == 0:
        plan.report_dir.mkdir(parents=True, exist_ok=True)
        (plan.report_dir / "selftest.json").write_text(json.dumps(report, indent=1))
        text = report_text(report)
        (plan.report_dir / "selftest.txt").write_text(text + "\n")
        print(text)
        print(f"report: {plan.report_dir / 'selftest.json'}, {plan.report_dir / 'selftest.txt'}")
        if passed:  # a failure's checkpoints stay for a look
            shutil.rmtree(plan.checkpoint_root, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return 0 if passed else 1


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`megalite-selftest [options] [[LAYOUT:]KEY=VALUE ...]`."""
    sys.exit(selftest(argv))


if __name__ == "__main__":
    main()
