#!/usr/bin/env bash
# Four short runs whose metrics must stay bitwise identical across a refactor:
#   scripts/dev/bitwise.sh OUT            # writes OUT/<run>.jsonl (step, loss, val_loss, grad_norm, param_norm)
#   scripts/dev/bitwise.sh OUT BASE       # ... and compares each file with BASE/<run>.jsonl
# Each run has its own hydra.run.dir (and so its own checkpoint dir) under OUT/runs/.
set -euo pipefail
out=$(realpath -m "$1"); base=${2:-}
mkdir -p "$out/runs"
export OMP_NUM_THREADS=1
common=(train.max_steps=12 log.every=1 log.wandb=false log.progress=false train.eval_every=6
        data.dir=data/stdlib checkpoint.every=6 model.resid_pdrop=0.1 model.attn_pdrop=0.1)
run() {  # name, launcher...
  local name=$1; shift
  "$@" scripts/pretrain.py "${common[@]}" "${extra[@]}" hydra.run.dir="$out/runs/$name" \
    > "$out/runs/$name.log" 2>&1
  python - "$out/runs/$name/metrics.jsonl" "$out/$name.jsonl" <<'PY'
import json, sys
keys = ("step", "loss", "val_loss", "grad_norm", "param_norm")
with open(sys.argv[1]) as src, open(sys.argv[2], "w") as dst:
    for line in src:
        rec = json.loads(line)
        picked = {k: rec[k] for k in keys if k in rec}
        if "step" in picked and len(picked) > 1:
            dst.write(json.dumps(picked, sort_keys=True) + "\n")
PY
}
extra=(); run serial python
extra=(tp=2 pp=2 sp=true); run tp2pp2sp torchrun --standalone --nproc_per_node=4
extra=(zero=3 offload.optimizer=0.5); run zero3offload torchrun --standalone --nproc_per_node=2
extra=(pp=2 parallel.schedule=zb-v parallel.virtual_stages=2 model.n_layer=4)
run zbv torchrun --standalone --nproc_per_node=2
if [[ -n "$base" ]]; then
  status=0
  for name in serial tp2pp2sp zero3offload zbv; do
    if cmp -s "$base/$name.jsonl" "$out/$name.jsonl"; then echo "$name: identical ($(wc -l < "$out/$name.jsonl") records)"
    else echo "$name: DIFFERENT"; status=1; fi
  done
  exit $status
fi
