"""Hang dumps (`resilience.hang_dump`): when an operation of one rank is not complete after its
group's threshold (`resilience.hang_after_s`, judged by completion: the flight recorder's
probes, looked at by the watch thread, `megalite.resilience.flight`), or when a collective
fails or times out (gloo raises at `parallel.timeout_s`), every rank that can writes
`<run dir>/hang/rank<r>.json` — the Python stack of each of its threads and its flight
recorder (the last operations per group, with their sequence numbers and how far they
arrived and completed) — and the rank that noticed writes `<run dir>/hang/summary.txt`,
naming the ranks that did not arrive and the group (`megalite.resilience.hang_report`).
Under NCCL, where a collective does not raise but the watchdog ends the process at the
timeout, the threshold's dump is the one written: before the process is torn down. A stuck
operation that completes after all turns its dump into a live one (moved to hang/live/, every
rank told by a `resolved` request) and training goes on.

How the ranks learn of it: through the store every rank already shares
(`megalite.resilience.hang_store`: keys scoped by the request's number; no store operation per
rank grows with the world size). The rank whose collective failed dumps at once, posts a
request, and waits up to `resilience.hang_wait_s` for every rank's answer before its error
(`CommError`) goes on (the store calls run in a thread given at most hang_wait_s + 5 s: a
store on a lost node may never answer). Every rank runs a watch thread while `fit` trains,
which looks for a new request every `poll_s` = min(2, hang_wait_s / 4) seconds: it does not
need the training thread, which may be stuck in compute or blocked in a collective (the wait
releases the GIL), so a rank that stopped participating still dumps, and its stack shows where
it is. It answers with its compact state (the groups' counters and the collectives it waits
for), from which the summary is made: no shared file system is needed for it. A rank whose
process is gone or whose interpreter is wedged writes nothing; the summary names it as a rank
without a dump. Outside `fit` (set-up, resume) no rank watches: a failing rank writes its own
dump only.

A live run can be dumped on demand: `resilience.hang_signal` (SIGUSR2 by default) sent to any
rank makes every rank dump and that rank write the summary, to `<run dir>/hang/live/` (a live
dump never overwrites a failure's); training goes on. The signal is seen by the watch thread
at once, also while the main thread blocks in C code (a wakeup file descriptor: CPython's
C-level handler writes the signal number there from whichever thread receives it).

Each rank writes one failure dump per process (later failures of the same broken process group
would overwrite the evidence; a later failure request is answered with the same state), and of
two ranks that notice a failure the first summary is kept; live dumps overwrite older live
ones. A dump is written to a temporary file and renamed, so a file that exists is complete.
`faulthandler` is enabled (all threads, to stderr) while watching: when NCCL's watchdog aborts
the process (SIGABRT) before Python can dump, the stacks still reach the rank's log (and
PyTorch's own NCCL flight recorder dumps to hang/, `megalite.resilience.nccl_flight`).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import List, Optional

from megalite.resilience.flight import (
    ENDED_AT,
    ERROR,
    FAILED,
    OP,
    PEERS,
    SEQ,
    STARTED_AT,
    STUCK,
    FlightRecorder,
)
from megalite.resilience.hang_files import dump_name, mark_failed, write_dump, write_summary
from megalite.resilience.hang_report import compact, summarize
from megalite.resilience.hang_store import HangExchange
from megalite.utils.clock import bind_cuda_device, thread_cuda_device
from megalite.utils.log import get_logger

WHAT_CHARS = 600  # of an error message put in a request
EVIDENCE = ("failure", "stuck")  # requests whose dumps go to hang/ (a live one's: hang/live/)
STORE_GRACE_S = 5.0  # beyond hang_wait_s, for the store calls of a failing rank's request


class HangWatch:
    """One rank's hang dumps; a context manager (`fit` trains inside it) that runs the watch
    thread and the signal handler, and makes a collective failure dump."""

    def __init__(self, recorder: FlightRecorder, run_dir: Path, rank: int, world_size: int,
                 wait_s: float, signal_name: Optional[str], store=None):
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.dir = Path(run_dir) / "hang"
        self.wait_s, self.poll_s = wait_s, min(2.0, wait_s / 4)
        self.signum = getattr(signal, signal_name) if signal_name else None
        self.exchange = None if store is None else HangExchange(store)
        self.seen = 0  # requests answered so far
        self.own: set = set()  # the numbers of this rank's own requests (answered by it)
        self.failure_dumped = False  # one dump per collective failure
        self.failure_state: Optional[dict] = None  # its compact state, to answer again
        self._lock = threading.Lock()  # one dump at a time
        self._numbering = threading.Lock()  # posting a request / looking for new ones
        self._stop = threading.Event()
        self._signalled = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._restore: list = []
        self._active = False  # inside the context (`fit`): the other ranks watch too
        self._warned: set = set()  # the parts of a look that failed (warned once each)
        self._stuck: Optional[tuple] = None  # (entry, request, helper thread) of this rank's
        #                                      stuck operation while its dump is the evidence
        recorder.on_failure = self.on_failure

    # --- the watch ---------------------------------------------------------------------

    def __enter__(self) -> "HangWatch":
        self._active = True
        self._stop.clear()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        if self.signum is not None and threading.current_thread() is threading.main_thread():
            self._install_signal()
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
            self._restore.append(faulthandler.disable)
        self._thread = threading.Thread(target=self._watch, args=(thread_cuda_device(),),
                                        name="megalite-hang-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        self._stop.set()
        self._wake_w.send(b"\0")
        self._thread.join(timeout=self.poll_s + 5)
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        self._wake_r.close()
        self._wake_w.close()

    def _install_signal(self) -> None:
        """The wakeup fd (written at once, from the C handler), and a Python handler, which
        must exist for it; the Python handler (run by the main thread once it returns to
        Python) raises the request only where another wakeup fd is set (an event loop's)."""
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        woken = old_fd == -1
        if woken:
            self._restore.append(lambda: signal.set_wakeup_fd(-1))
        else:  # someone else's: leave it theirs
            signal.set_wakeup_fd(old_fd)
        previous = signal.signal(self.signum,
                                 lambda *_: None if woken else self._signalled.set())
        self._restore.append(lambda: signal.signal(self.signum, previous))

    def _watch(self, cuda_device) -> None:
        """Look every `poll_s` (at once on a signal): at this rank's operations, at the
        signal, at the other ranks' requests. On CUDA it queries the recorder's probes on the
        device of the thread that started it (`cuda_device`), set first."""
        import selectors  # not select.select: it raises for a descriptor >= 1024, which a
        # process holding many gloo sockets or token shards reaches, and the watch would die

        bind_cuda_device(cuda_device)
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ)
            self._watch_loop(selector)

    def _watch_loop(self, selector) -> None:
        while not self._stop.is_set():
            ready = selector.select(self.poll_s)
            if self._stop.is_set():
                return
            if ready:
                received = self._wake_r.recv(4096)
                if self.signum is not None and self.signum in received:
                    self._signalled.set()
            self._guarded("look at its operations", self._look_at_recorder)
            if self._signalled.is_set():
                self._signalled.clear()
                name = signal.Signals(self.signum).name
                self._guarded("signal dump", lambda: self.request(
                    "signal", f"{name} received by rank {self.rank}"))
            self._guarded("answer to the other ranks", self._answer)

    def _guarded(self, what: str, part) -> None:
        """One part of a look, on its own: a part that raises (a probe's sticky CUDA error, a
        broken store) neither kills the watch nor stops the other parts — the rank still
        answers its peers and dumps on a signal. Warned once per part (a store that is gone
        fails every look)."""
        try:
            part()
        except Exception as e:  # noqa: BLE001 - the watch must not die
            if what not in self._warned:
                self._warned.add(what)
                get_logger().warning(f"hang watch on rank {self.rank}: its {what} failed: {e!r}")

    # --- requests and answers ----------------------------------------------------------

    def _new_request(self, kind: str, what: str) -> dict:
        return {"kind": kind, "rank": self.rank, "what": what[:WHAT_CHARS],
                "time": time.time(), "n": None}

    def _number(self, req: dict) -> None:
        """Post `req` (numbering it) where there is a store. Under `_numbering`, which the
        watch's look takes too: the number is this rank's own (`own`) before its watch can
        see it, so the requesting rank never answers its own request a second time."""
        if self.exchange is not None:
            with self._numbering:
                self.own.add(self.exchange.post(req))

    def on_failure(self, description: str, error: BaseException) -> None:
        """A collective of this rank failed (called before its CommError is raised): dump,
        ask every rank to, and write the summary; once per process. Outside the context
        (set-up, resume: the others do not watch) only this rank's dump."""
        req = self._new_request("failure", f"{description} failed: {error}")
        stuck = self._stuck
        if stuck is not None:  # the hang was dumped as stuck: its summary first
            stuck[2].join(timeout=self.wait_s + STORE_GRACE_S)
        helper = self._dump_and_ask(req)
        if helper is None:
            return
        # in a thread joined with a bound: a store on a lost node may not answer at all
        helper.start()
        helper.join(timeout=self.wait_s + STORE_GRACE_S)

    # --- an operation not complete after its group's threshold (`FlightRecorder.poll`) ------

    def _look_at_recorder(self) -> None:
        """The watch's look at this rank's own operations (no store traffic): what completed,
        what is stuck, what failed (a probe's Work with an error: NCCL reports it completed);
        a stuck dump whose operation completed after all becomes a live one."""
        stuck = self.recorder.poll(time.time())
        dumped_stuck = self._stuck
        if self._stuck is not None:
            self._resolve_if_completed()
        failed = [s for s in stuck if s[3][FAILED]]
        if failed:
            self.on_probe_failed(*failed[0], dumped_stuck)
        elif stuck:
            self.on_stuck(*stuck[0])

    def on_stuck(self, name: str, ranks: List[int], threshold: float, entry: list) -> None:
        """An operation of this rank is not complete `threshold` seconds after its launch
        (under NCCL its peers' watchdogs are about to end the processes): dump, ask every rank
        to, and write the summary to hang/ — as a failure does, but before the process is
        torn down. The request runs in a helper thread: this watch goes on answering."""
        kind = f"p2p #{entry[SEQ]}" if entry[PEERS] is not None else f"#{entry[SEQ]}"
        age = time.time() - entry[STARTED_AT]
        req = self._new_request("stuck", (
            f"{entry[OP]} {kind} on the {name} group (global ranks {ranks}) not complete "
            f"{age:.1f} s after its launch (the group's hang threshold: {threshold:g} s, "
            "resilience.hang_after_s)"))
        helper = self._dump_and_ask(req)
        if helper is None:  # this hang is dumped already (another rank asked first):
            entry[STUCK] = False  # judged again once that dump is resolved
            return
        self._stuck = (entry, req, helper)
        helper.start()

    def _dump_and_ask(self, req: dict) -> Optional[threading.Thread]:
        """This rank's evidence dump for `req` (none if one is its evidence already: None
        returned), first, as it needs no store; then, inside the context, the helper thread
        (not started) that asks every rank to dump and writes the summary (outside it, set-up
        or resume where the others do not watch, a thread that does nothing). A failure and a
        stuck or failed operation are dumped and asked for alike."""
        with self._lock:
            if self.failure_dumped:
                return None
            self.failure_dumped = True
            self.failure_state = compact(self._dump(req, failure=True))
        if not self._active:
            return threading.Thread(target=lambda: None)
        return threading.Thread(target=self._ask_logged, args=(req, self.failure_state),
                                name="megalite-hang-request", daemon=True)

    def on_probe_failed(self, name: str, ranks: List[int], threshold: float, entry: list,
                        dumped_stuck: Optional[tuple]) -> None:
        """An operation's Work ended with an error (NCCL's watchdog timeout, a remote error:
        `FlightRecorder.poll`): a failure, never a completion. Dumped and asked for as a
        failure; where it was dumped as stuck already (`dumped_stuck`), that dump stays in
        hang/ as its evidence and its summary is marked failed once written."""
        kind = f"p2p #{entry[SEQ]}" if entry[PEERS] is not None else f"#{entry[SEQ]}"
        what = (f"{entry[OP]} {kind} on the {name} group (global ranks {ranks}) failed "
                f"{time.time() - entry[STARTED_AT]:.1f} s after its launch: {entry[ERROR]}")
        get_logger().warning(f"hang watch on rank {self.rank}: {what}")
        if dumped_stuck is not None and dumped_stuck[0] is entry:
            marker = threading.Thread(target=self._mark_failed, args=(dumped_stuck[2], what),
                                      name="megalite-hang-request", daemon=True)
            marker.start()
            return
        helper = self._dump_and_ask(self._new_request("failure", what))
        if helper is not None:
            helper.start()

    def _mark_failed(self, helper: threading.Thread, what: str) -> None:
        """Once the stuck operation's summary is written (`helper` done), say in it that the
        operation failed: its first line and the request's `failed` field."""
        helper.join(timeout=self.wait_s + STORE_GRACE_S)
        mark_failed(self.dir, what)

    def _resolve_if_completed(self) -> None:
        """The stuck operation completed after all (and its request is answered): its dump
        and summary move to hang/live/, every rank is told to move its own (a `resolved`
        request), and training goes on; a later hang dumps again."""
        entry, req, helper = self._stuck
        if entry[FAILED]:  # it failed: the dump stays the failure's evidence
            self._stuck = None
            return
        if entry[ENDED_AT] is None or helper.is_alive():
            return
        self._stuck = None
        with self._lock:
            self._to_live([dump_name(self.rank), "summary.txt", "summary.json"])
            self.failure_dumped, self.failure_state = False, None
        if self.exchange is not None and req["n"] is not None:
            resolved = self._new_request("resolved", f"request {req['n']} completed after all")
            resolved["of"] = req["n"]
            self._number(resolved)
        get_logger().warning(
            f"hang dump: {req['what'].split(' not complete')[0]} completed after all, "
            f"{entry[ENDED_AT] - entry[STARTED_AT]:.1f} s after its launch: the dump is a "
            f"live one now ({self.dir / 'live'}); training goes on")

    def _to_live(self, names: List[str]) -> None:
        """Move this rank's evidence files to hang/live/ (the caller holds `_lock`)."""
        live = self._dir(failure=False)
        live.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (self.dir / name).exists():
                os.replace(self.dir / name, live / name)

    def _ask_logged(self, req: dict, state: dict) -> None:
        try:
            self._number(req)
            self._ask(req, state, failure=True)
        except Exception as e:  # the error being raised is the one to report
            get_logger().warning(f"hang dump on rank {self.rank} failed: {e!r}")

    def request(self, kind: str, what: str) -> Path:
        """A live dump (no failure): number the request, dump this rank, ask the others, wait
        for their answers up to `wait_s` and write the summary. Returns the summary's path."""
        req = self._new_request(kind, what)
        self._number(req)
        with self._lock:
            state = compact(self._dump(req, failure=False))
        return self._ask(req, state, failure=False)

    def _ask(self, req: dict, state: dict, failure: bool) -> Path:
        """Answer `req` with this rank's `state`, collect the others' and write the
        summary."""
        states = {self.rank: state}
        if self.exchange is not None:
            self.exchange.answer(req["n"], state)
            states = self.exchange.collect(req["n"], self.world_size, self.wait_s)
        text, summary = summarize(states, self.world_size, req)
        path = write_summary(self._dir(failure), text, summary, keep_first=failure)
        get_logger().warning(f"hang dump: {text}")
        return path

    def _answer(self) -> None:
        """Answer the other ranks' requests added since the last look (usually none): one
        dump for all of them. A failure request finds this rank's failure dump, if it has
        one, already written: its state answers again (one failure dump per process)."""
        if self.exchange is None:
            return
        with self._numbering:
            latest = self.exchange.latest()
            if latest <= self.seen:
                return
            numbers = [n for n in range(self.seen + 1, latest + 1) if n not in self.own]
            self.seen = latest
        if not numbers:
            return
        reqs = self.exchange.requests(numbers)
        resolved = {r["of"] for r in reqs if r["kind"] == "resolved"}
        for n in resolved:
            self._resolved(n)
        # (a stuck request resolved already is not answered: its requester has its summary)
        reqs = [r for r in reqs if r["kind"] != "resolved" and r["n"] not in resolved]
        numbers = [r["n"] for r in reqs]
        if not reqs:
            return
        failures = [r for r in reqs if r["kind"] in EVIDENCE]
        with self._lock:
            if failures and self.failure_dumped:
                state = self.failure_state
            else:
                state = compact(self._dump(failures[0] if failures else reqs[-1],
                                           failure=bool(failures)))
                if failures:
                    self.failure_dumped, self.failure_state = True, state
        for n in numbers:
            self.exchange.answer(n, state)

    def _resolved(self, n: int) -> None:
        """Request `n` (a stuck operation) completed after all: this rank's dump for it, if
        that is its evidence, moves to hang/live/."""
        with self._lock:
            if self.failure_state is not None and self.failure_state["request"].get("n") == n:
                self._to_live([dump_name(self.rank)])
                self.failure_dumped, self.failure_state = False, None

    def _dir(self, failure: bool) -> Path:
        """A failure's dumps in hang/, a live dump's in hang/live/: a signal never overwrites
        the evidence of a failure."""
        return self.dir if failure else self.dir / "live"

    def _dump(self, req: dict, failure: bool) -> dict:
        """Write this rank's dump (the caller holds `_lock`); returns it."""
        return write_dump(self._dir(failure), self.rank, self.world_size, req, failure,
                          self.recorder.snapshot())
