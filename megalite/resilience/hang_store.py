"""How the hang dumps' requests and answers travel (`megalite.resilience.hang`): through the
c10d store every rank already shares (the default process group's; on torchrun the agent's),
under the prefix `megalite/hang/`, in keys scoped by the request's number n, so that an
answer to one request is never read as an answer to another:

    requests      a counter: the number of the latest request (every watch thread reads it)
    request/<n>   request n: kind, requesting rank, what happened, time, n (JSON)
    acks/<n>      a counter: how many ranks have answered request n
    states/<n>    the answering ranks' compact states (`hang_report.compact`), one JSON line
                  each, appended: the requester reads them all in one call

Store operations (one round trip to the store's server each) — none grows with the world
size (`tests/*/*/test_hang.py` counts them on an in-memory store for 2 and 4,096 ranks):

    a watch thread's look for a new request         1   (`requests`)
    answering k new requests (usually k = 1)        1 + 2 k   (one multi_get, then per
                                                              request an append and an add)
    posting a request                               2
    collecting its answers                          1 every 50 ms until all ranks answered
                                                    or `hang_wait_s` passed, then 1

What does grow with the world size is the store server's load from the looks: every rank
looks every `poll_s` = min(2, hang_wait_s / 4) seconds, e.g. 4,096 ranks at 2 s make ~2,000
one-counter reads a second, each a few bytes (the requester reads the states, ~1-2 KB per
rank, once per request).
"""
from __future__ import annotations

import json
import time
from typing import Dict, List

PREFIX = "megalite/hang/"
COLLECT_POLL_S = 0.05


def default_store():
    """The default process group's store, namespaced; None without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())


class HangExchange:
    """Requests and answers of the hang dumps in a c10d store (`store`: any with add, set,
    multi_get, append and get, e.g. a PrefixStore over the default store or a HashStore)."""

    def __init__(self, store):
        self.store = store

    def latest(self) -> int:
        """The number of the latest request (0: none yet). One store operation."""
        return self.store.add("requests", 0)

    def post(self, req: dict) -> int:
        """Number `req` (sets req["n"]) and publish it; returns its number."""
        req["n"] = self.store.add("requests", 1)
        self.store.set(f"request/{req['n']}", json.dumps(req))
        return req["n"]

    def requests(self, numbers: List[int]) -> List[dict]:
        """Requests `numbers` (posted: a number exists only once its request is being set)."""
        return [json.loads(v) for v in
                self.store.multi_get([f"request/{n}" for n in numbers])]

    def answer(self, n: int, state: dict) -> None:
        """This rank's compact state answers request `n`."""
        self.store.append(f"states/{n}", json.dumps(state, separators=(",", ":")) + "\n")
        self.store.add(f"acks/{n}", 1)

    def collect(self, n: int, world_size: int, wait_s: float) -> Dict[int, dict]:
        """The compact states that answered request `n` within `wait_s` (the requester's own
        included: it answers before it collects), by rank."""
        deadline = time.monotonic() + wait_s
        while (self.store.add(f"acks/{n}", 0) < world_size
               and time.monotonic() < deadline):
            time.sleep(COLLECT_POLL_S)
        lines = self.store.get(f"states/{n}").decode().splitlines()
        states = (json.loads(line) for line in lines if line)
        return {s["rank"]: s for s in states}
