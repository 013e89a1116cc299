"""The hang summary: from the ranks' dumps (`megalite.resilience.hang`), which ranks did not
arrive, and in which group.

A rank waiting in a collective with sequence number s on a group waits for the members that
have launched fewer than s collectives there (every member launches the same ones in the same
order), and for the members that wrote no dump. In a point-to-point transfer it waits for its
peers, unless a peer waits in a transfer with it too. These waits form a graph; the ranks
that did not arrive are the ones waited for that wait for nobody (they are computing, sleeping,
stuck outside any collective — their stack says where — or gone). When every rank waited for
waits itself (a cycle: ranks entered different collectives), all of them are named.

`megalite-hang-report RUN_DIR` (megalite/cli/hang_report.py) prints the summary of the dumps
in RUN_DIR/hang/ after the fact (the rank that noticed the hang writes the same summary to
hang/summary.txt, from the states the ranks put in the store). It reads a collective
failure's dumps (hang/); where there are none, the latest live dump's (hang/live/, written on
`resilience.hang_signal`); `megalite-hang-report RUN_DIR/hang/live` reads the live one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

WHERE_FRAMES = 3  # innermost frames of the main thread quoted in the summary


def compact(state: dict) -> dict:
    """What the summary needs of a dump: per group the counters, the collectives waited for
    and the last one; the main thread's innermost frames. Idempotent."""
    groups = [{"group": g["group"], "ranks": g["ranks"], "started": g["started"],
               "arrived": g.get("arrived", g["started"]),
               "completed": g.get("completed"), "p2p_started": g["p2p_started"],
               "p2p_with": g.get("p2p_with", {}),
               "waiting": g["waiting"] if "waiting" in g else _pending(g["last"]),
               "last": g["last"][-1:]} for g in state["groups"]]
    main = [frames for name, frames in state.get("stacks", {}).items()
            if name.startswith("MainThread ")]
    keep = ("rank", "world_size", "host", "pid", "time", "request", "failure")
    return {**{k: state[k] for k in keep}, "groups": groups,
            "where": main[0][-WHERE_FRAMES:] if main else state.get("where", [])}


def _pending(entries: List[dict]) -> List[dict]:
    """The operations not complete at the dump: those a thread waits for, and (in dumps that
    judge completion, with `stuck` in their entries) every operation launched and not done."""
    return [e for e in entries if e["ended_at"] is None and ("stuck" in e or e["waiting"])]


def _key(g: dict) -> Tuple[str, Tuple[int, ...]]:
    return g["group"], tuple(g["ranks"])


def _describe(g: dict) -> str:
    return f"the {g['group']} group (global ranks {g['ranks']})"


def find_waits(states: Dict[int, dict]) -> List[dict]:
    """Every collective a rank waits in, with the members it waits for: {peer: collectives
    that peer launched on the group, or None when it wrote no dump}."""
    index = {r: {_key(g): g for g in compact(s)["groups"]} for r, s in states.items()}
    waits = []
    for r, st in sorted(states.items()):
        for key, g in index[r].items():
            for e in g["waiting"]:
                behind, launched = {}, {}
                if "peer_seq" in e:  # point-to-point: the n-th batch between two stages is
                    for p, n in e["peer_seq"].items():  # the same round on both
                        theirs = index.get(int(p), {}).get(key)
                        posted = theirs["p2p_with"].get(str(r), 0) if theirs else 0
                        if int(p) not in states or posted < n:
                            behind[int(p)] = None if int(p) not in states else posted
                elif "peers" in e:  # (older dumps) blocked by a peer not transferring with it
                    for p in e["peers"]:
                        theirs = index.get(p, {}).get(key)
                        back = theirs and any("peers" in w and r in w["peers"]
                                              for w in theirs["waiting"])
                        if not back:
                            behind[p] = None if p not in states else \
                                (theirs["p2p_started"] if theirs else 0)
                else:  # a collective: its members that have not arrived at it
                    for p in g["ranks"]:
                        theirs = index.get(p, {}).get(key)
                        arrived = theirs["arrived"] if theirs else 0
                        if p != r and (p not in states or arrived < e["seq"]):
                            behind[p] = None if p not in states else arrived
                            if theirs and theirs["started"] != arrived:  # CUDA: launched,
                                launched[p] = theirs["started"]  # its device not there yet
                waits.append({"rank": r, "group": g["group"], "ranks": g["ranks"],
                              "op": e["op"], "seq": e["seq"], "p2p": "peers" in e,
                              "waited_s": round(st["time"] - e["started_at"], 3),
                              "stuck": bool(e.get("stuck")), "behind": behind,
                              "launched": launched, "failed": bool(e.get("failed")),
                              "error": e.get("error")})
    return waits


def summarize(states: Dict[int, dict], world_size: int, request: Optional[dict] = None
              ) -> Tuple[str, dict]:
    """(text, dict) of the summary of the dumps `states` (full or compact, by rank)."""
    states = {int(r): compact(s) for r, s in states.items()}
    waits = find_waits(states)
    waiting = {w["rank"] for w in waits if w["behind"]}
    targets = sorted({p for w in waits for p in w["behind"]})
    missing = [p for p in targets if p not in waiting]
    cycle = bool(targets) and not missing
    if cycle:
        missing = targets
    groups = [{"group": w["group"], "ranks": w["ranks"]} for w in waits
              if set(w["behind"]) & set(missing)]
    groups = [g for i, g in enumerate(groups) if g not in groups[:i]]
    no_dump = [r for r in range(world_size) if r not in states]
    summary = {"request": request, "world_size": world_size, "dumps": sorted(states),
               "no_dump": no_dump, "did_not_arrive": missing, "groups": groups,
               "cycle": cycle, "waits": waits}
    return _text(summary, states), summary


def _text(s: dict, states: Dict[int, dict]) -> str:
    req = s["request"] or {}
    lines = [f"hang summary ({req.get('kind', 'dump')} on rank {req.get('rank')}: "
             f"{req.get('what', '')})",
             f"dumps from {len(s['dumps'])} of {s['world_size']} ranks; "
             + (f"no dump from ranks {s['no_dump']} (gone, wedged, or no answer within "
                "resilience.hang_wait_s)" if s["no_dump"] else "every rank dumped")]
    times = [st["time"] for st in states.values()]
    if req.get("kind") != "failure" and len(times) > 1:
        lines.append(f"a live dump: the ranks dumped within {max(times) - min(times):.1f} s "
                     "of each other, so a rank behind may only have been dumped earlier")
    if not s["did_not_arrive"]:
        lines.append("every rank waited for has arrived (no rank is missing)")
    else:
        where = "; ".join(_describe(g) for g in s["groups"])
        kind = "waiting for each other (different collectives: a cycle)" if s["cycle"] \
            else "did not arrive"
        lines.append(f"{kind}: rank{'s' * (len(s['did_not_arrive']) > 1)} "
                     f"{', '.join(map(str, s['did_not_arrive']))} in {where}")
    for w in s["waits"]:
        if w.get("failed"):
            lines.append(f"  rank {w['rank']}: {w['op']} #{w['seq']} on {_describe(w)} "
                         f"failed: {w.get('error')}")
        if not w["behind"]:
            continue
        peers = ", ".join(f"rank {p} (" + _where(w, p, n) + ")"
                          for p, n in w["behind"].items())
        seq = f"{'p2p ' if w['p2p'] else ''}#{w['seq']}"
        lines.append(f"  rank {w['rank']} waited {w['waited_s']:.1f} s in {w['op']} {seq} on "
                     f"{_describe(w)} for {peers}")
    for r in s["did_not_arrive"]:
        if r in states and states[r]["where"]:
            lines.append(f"  rank {r} (host {states[r]['host']}, pid {states[r]['pid']}), "
                         "main thread:")
            lines += ["    " + line.rstrip().replace("\n", "\n    ")
                      for line in states[r]["where"]]
    return "\n".join(lines)


def _where(w: dict, p, n: Optional[int]) -> str:
    if n is None:
        return "no dump"
    if w["p2p"]:
        return f"posted {n} transfer rounds with it"
    launched = w.get("launched", {}).get(p, w.get("launched", {}).get(str(p)))
    if launched is not None:
        return f"launched {launched} there, its device at {n}"
    return f"launched {n} there"


def load_dumps(hang_dir: Path) -> Tuple[Dict[int, dict], int, Optional[dict]]:
    """The dumps of one event in `hang_dir`: (states by rank, world size, the request). A
    failure's dumps in hang/, or where there are none, the live dump's in hang/live/."""
    if not any(hang_dir.glob("rank*.json")) and (hang_dir / "live").is_dir():
        hang_dir = hang_dir / "live"
    dumps = [json.loads(p.read_text()) for p in sorted(hang_dir.glob("rank*.json"))]
    if not dumps:
        raise FileNotFoundError(f"{hang_dir}: no rank*.json hang dumps")
    failed = [d for d in dumps if d["failure"]]
    if failed:
        dumps = failed
    else:
        latest = max(d["request"].get("n") or 0 for d in dumps)
        dumps = [d for d in dumps if (d["request"].get("n") or 0) == latest]
    first = min(dumps, key=lambda d: d["request"]["time"])
    return {d["rank"]: d for d in dumps}, dumps[0]["world_size"], first["request"]
