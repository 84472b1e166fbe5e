#!/bin/bash
# Record the FedMA runs of `fedfuse reproduce fedma --part mlp` (docs/fedma.md, "Accuracy vs number of clients
# at equal communication") into the table fedma-clients:
#   results/record-fedma.sh COMMIT OUT [OUT ...]
# COMMIT: the fedfuse commit the reproduction ran on; OUT: its --out (holding results.json, which names every
# table's run directories per row and seed).  One `fedfuse results record` per cell (clients, comms, method);
# the ensemble and one-shot fusions run once (communication 0) and are recorded in each comms cell they are
# compared in, as the reproduction's own tables list them.
set -euo pipefail
COMMIT=${1:?commit}; shift
for OUT in "$@"; do
  python3 - "$OUT/results.json" <<'PY' | while IFS=$'\t' read -r cell dirs; do
import json, re, sys
for tid, t in json.load(open(sys.argv[1])).items():
    m = re.fullmatch(r"mlp-sgd-(\d+)clients-(\d+)comms", tid)
    if not m:
        continue
    for label, runs in t["runs"].items():
        print(f"clients={m[1]},comms={m[2]},method={label}\t" + " ".join(r["dir"] for r in runs))
PY
    # shellcheck disable=SC2086
    fedfuse results record --table fedma-clients --cell "$cell" --commit "$COMMIT" $dirs
  done
done
