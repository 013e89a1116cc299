"""The self-test's plan (`megalite-selftest`, `megalite.cli.selftest`): everything decided and
validated before any work — the layouts that fit this world, each one's configuration, the
serial reference, the resume pair, the links to measure — or BadInput / ConfigError."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megalite.config.errors import ConfigError
from megalite.config.layout import device_type_for, resolved_precision, validate
from megalite.config.schema import load_config
from megalite.train import selftest as st
from megalite.train.runtime import local_gpu, local_gpus

CHECKPOINT_SUBDIR = "megalite-selftest"


class BadInput(ValueError):
    """What the self-test refuses before any work, naming it."""


@dataclass
class Plan:
    """What this launch will check, decided (and validated) before any work."""

    world: int
    per_node: int
    base: object  # Config
    checks: List[st.LayoutCheck]
    skipped: List[str]
    configs: Dict[str, object]  # layout name -> Config
    serial: object  # Config
    tolerance: st.Tolerance
    precision: str
    checkpoint_root: Path
    report_dir: Path
    resume: Optional[tuple]  # (source layout, target layout) names
    links: List[str] = field(default_factory=list)
    args: Optional[argparse.Namespace] = None


def split_overrides(overrides: Sequence[str]) -> tuple:
    """(every run's overrides, {layout: its own}): `LAYOUT:KEY=VALUE` is one layout's."""
    common: List[str] = []
    scoped: Dict[str, List[str]] = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" not in o:
            raise BadInput(f"{o!r}: an override is KEY=VALUE or LAYOUT:KEY=VALUE")
        if ":" in key:
            layout, rest = o.split(":", 1)
            scoped.setdefault(layout, []).append(rest)
        else:
            common.append(o)
    return common, scoped


def _writable(path: Path, what: str, probe: str) -> None:
    """`path` exists (made) and takes a file, or BadInput naming `what`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        test = path / f".{probe}.{os.getpid()}"
        test.write_text("megalite-selftest")
        test.unlink()
    except OSError as e:
        raise BadInput(f"{what}={str(path)!r} is not writable here ({e.strerror or e}); "
                       "give a directory this rank can write") from e


def make_plan(args, world: int, per_node: int, rank: int, data_dir: Path) -> Plan:
    """Everything decided and validated before any work (BadInput / ConfigError)."""
    if args.steps < 2 or not 1 <= args.save_at < args.steps:
        raise BadInput(f"--steps {args.steps} --save-at {args.save_at}: needs steps >= 2 and "
                       "1 <= save-at < steps (the resumed layout trains the steps after it)")
    if world % per_node:
        raise BadInput(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={per_node}: "
                       "start the same number of ranks on every node")
    common, scoped = split_overrides(args.overrides)
    head = [*st.SELFTEST_MODEL, *st.SELFTEST_TRAIN, f"data.dir={data_dir}",
            f"train.global_batch_size={max(2, world)}", "precision=fp32"]  # unless given
    base = load_config([*head, *common])
    gpu = local_gpu()
    precision = resolved_precision(base.precision, device_type_for(base.device, local_gpus()),
                                   gpu is None or gpu.bf16)
    checks, skipped = st.layout_checks(world, per_node, base.model.n_head, base.model.n_layer)
    checks = _selected(args.layouts, checks, skipped, scoped, world, per_node)
    root = Path(base.checkpoint.dir) / CHECKPOINT_SUBDIR if base.checkpoint.dir \
        else Path(args.report_dir) / "checkpoints"
    if rank == 0:
        _writable(Path(args.report_dir), "--report-dir", "probe")
    _writable(root, "checkpoint.dir" if base.checkpoint.dir else "--report-dir",
              f"probe{rank}")
    configs = {}
    for check in checks:
        own = {"checkpoint.dir": str(root / check.name), "train.micro_batch_size":
               st.micro_batch_size(check, world, base.train.global_batch_size)}
        cfg = st.configure(base, check, **own)
        if check.name in scoped:  # this layout's own overrides: composed for it alone
            cfg = st.configure(load_config([*head, *common, *scoped[check.name]]), check, **own)
        try:
            validate(cfg, world, local_gpus(), per_node, gpu)
        except ConfigError as e:
            raise BadInput(f"layout {check.name} ({check.describe()}): {e}") from e
        configs[check.name] = cfg
    serial = st.configure(base, None, **{"checkpoint.dir": str(root / "serial")})
    validate(serial, 1)
    resume = None if args.no_resume else _resume_pair(checks, scoped)
    links = []
    if world > 1 and not args.no_links:
        links = (["intra_node"] if per_node > 1 else []) + \
            (["inter_node"] if world // per_node > 1 else [])
    return Plan(world, per_node, base, checks, skipped, configs, serial,
                st.TOLERANCES.get(precision, st.TOLERANCES["bf16"]), precision, root,
                Path(args.report_dir), resume, links)


def _selected(layouts: Optional[List[str]], checks: List[st.LayoutCheck], skipped: List[str],
              scoped: Dict[str, List[str]], world: int, per_node: int) -> List[st.LayoutCheck]:
    """The layouts `--layouts` asks for (all that fit when None), refused when unknown, not
    fitting this world, or none; a scoped override must name one of them."""
    names = [c.name for c in checks]
    if layouts is not None:
        known = {"tp", "pp", "cp", "zero", "combined", "recompute"}
        unknown = [n for n in layouts if n not in names and
                   not any(n.startswith(k) for k in known)]
        if unknown:
            raise BadInput(f"--layouts {' '.join(unknown)}: unknown; the layouts of this world "
                           f"({world} ranks, {per_node} a node): {', '.join(names)}")
        missing = [n for n in layouts if n not in names]
        if missing:
            raise BadInput(f"--layouts {' '.join(missing)}: does not fit this world ({world} "
                           f"ranks, {per_node} a node{''.join('; ' + s for s in skipped)}); "
                           f"the layouts that fit: {', '.join(names)}")
        checks = [c for c in checks if c.name in layouts]
    for name in scoped:
        if name not in [c.name for c in checks]:
            raise BadInput(f"{name}:...: no layout {name!r} runs here (they are: "
                           f"{', '.join(c.name for c in checks)})")
    if not checks:
        raise BadInput(f"a world of {world} ranks ({per_node} a node) fits none of the layouts "
                       f"asked for ({'; '.join(skipped)})")
    return checks


def _resume_pair(checks: List[st.LayoutCheck], scoped: Dict[str, List[str]]) -> tuple:
    """(the layout whose checkpoint is resumed, the layout resuming it; None: the serial
    layout, one rank)."""
    names = [c.name for c in checks if c.name not in scoped]  # (a drill's would carry its
    names = names or [c.name for c in checks]                   #  fault)
    source = "zero1" if "zero1" in names else names[0]
    names = [c.name for c in checks]
    others = [n for n in ("combined", "pp2-1f1b", *names) if n in names and n != source]
    return source, (others[0] if others else None)
