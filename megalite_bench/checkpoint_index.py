"""The checkpoint index a resuming rank reads at scale, from the real pieces of one rank of an
N-rank layout built in a simulated world (`megalite.train.simulated`'s fake process group, tensors
on the meta device):

    python scripts/bench.py checkpoint-index --world-size 4096 model=gpt2-xl pp=2 zero=3 \\
        train.micro_batch_size=1 train.global_batch_size=2048

Format 4 kept one JSON record per piece (with its tensor's split) in meta.json, parsed by every
rank; format 5 keeps one index file per tensor and a rank reads those of the tensors it owns
part of. The pieces of the rank's whole stage are counted from its flat buffers (each cut at
every DP shard boundary; every rank of a stage holds the same buffers), so the figures are the
index of the built layout, not a model of it; the JSON size per record is measured on records
of this run's names and sizes."""
from __future__ import annotations

import json
from typing import Dict

from megalite.checkpoint.format import KINDS, written_range
from megalite.checkpoint.index import spec_record
from megalite.config.layout import Layout
from megalite.train.preflight import validated_config
from megalite.train.simulated import build_parts, fake_world


def stage_piece_counts(engine) -> Dict[str, int]:
    """Per global tensor of this rank's stage, the pieces all writers of one TP rank produce:
    its elements cut at every DP shard boundary of its flat buffer."""
    count: Dict[str, int] = {}
    for bucket in engine.buckets:
        flat = bucket.flat
        for p, spec, off in zip(flat.params, flat.specs, flat.offsets):
            if spec.tied_copy:
                continue
            first, last = off // flat.shard_numel, (off + p.numel() - 1) // flat.shard_numel
            count[spec.name] = count.get(spec.name, 0) + last - first + 1
    return count


def run(args) -> dict:
    cfg, _ = validated_config(args.overrides, args.world_size, 8, "cuda")
    layout = Layout.from_config(cfg, args.world_size, "cuda")
    with fake_world(args.rank, args.world_size):
        topo, _, engine, _ = build_parts(cfg, layout)
        pieces = [p for p in engine.state_pieces() if written_range(p, topo)]
        file = f"rank{args.world_size - 1:05d}.bin"
        v4 = [{"name": p.spec.name, "kind": k, "tp_rank": topo.tp_size - 1, "lo": p.lo,
               "hi": p.hi, "file": file, "offset": 4 * p.spec.shape[0] * 10**6,
               "spec": spec_record(p.spec, topo.tp_size)} for p in pieces for k in KINDS]
        v5 = [[r["tp_rank"], r["lo"], r["hi"], r["file"], r["offset"]] for r in v4]
        per4, per5 = len(json.dumps(v4)) / len(v4), len(json.dumps(v5)) / len(v5)
        counts = stage_piece_counts(engine)
        owned = {p.spec.name for p in engine.state_pieces()}
        stage = sum(counts.values()) * len(KINDS) * topo.tp_size
        mine = sum(counts[n] for n in owned if n in counts) * len(KINDS) * topo.tp_size
    out = {"world_size": args.world_size, "rank": args.rank,
           "format4_meta_index_mb": stage * layout.pp_size * per4 / 1e6,
           "format5_stage_index_mb": stage * per5 / 1e6, "format5_index_files": len(counts),
           "format5_rank_reads_mb": mine * per5 / 1e6, "tensors_owned": len(owned)}
    print(f"checkpoint index at {args.world_size} ranks ({' '.join(args.overrides)}), rank "
          f"{args.rank}: format 4: {out['format4_meta_index_mb']:.0f} MB of piece records in "
          f"meta.json, parsed by every rank; format 5: {out['format5_stage_index_mb']:.1f} MB "
          f"of index for the stage in {len(counts)} files, of which this rank reads "
          f"{out['format5_rank_reads_mb']:.1f} MB ({len(owned)} tensors it owns part of)")
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt2-xl pp=2")
