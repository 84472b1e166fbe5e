#!/bin/bash
# Record the runs of `fedfuse reproduce fedmerge-lora --quick` (docs/lora.md, "Measured here (CPU, scaled
# down)") into the table fedmerge-lora:
#   results/record-fedmerge-lora.sh COMMIT OUT [OUT ...]
# COMMIT: the fedfuse commit the reproduction ran on; OUT: its --out (holding results.json, which names the
# run directories per row and seed of its table lora-roles or lora-tasks).  One `fedfuse results record` per
# cell (split, method).  The run config names a Shakespeare run only: --federation records how the clients
# were built (task split, quick sizes, rank, targets) and the sha256 of the pretrained base's weights, so that
# `fedfuse results verify` rebuilds them on the same base (fedfuse.reproduce.fedmerge_lora.rebuild).
set -euo pipefail
COMMIT=${1:?commit}; shift
for OUT in "$@"; do
  python3 - "$OUT/results.json" <<'PY' | while IFS=$'\t' read -r cell fed dirs; do
import json, sys
from fedfuse.reproduce.fedmerge_lora import base_state_sha256, record_federation
from fedfuse.result import load

for tid, t in json.load(open(sys.argv[1])).items():
    if tid not in ("lora-roles", "lora-tasks"):
        continue
    for label, runs in t["runs"].items():
        cfg = load(runs[0]["dir"]).config
        opts = cfg.algorithm_options
        fed = record_federation(tid.split("-")[1], quick=cfg.rounds == 5, rank=int(opts["rank"]),
                                targets=",".join(opts["targets"]),
                                base_sha=base_state_sha256(str(opts["base"]).removeprefix("fedfuse:")))
        print(f"split={tid.split('-')[1]},method={label}\t{json.dumps(fed)}\t" + " ".join(r["dir"] for r in runs))
PY
    # shellcheck disable=SC2086
    fedfuse results record --table fedmerge-lora --cell "$cell" --commit "$COMMIT" --federation "$fed" $dirs
  done
done
