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
  python3 "$(dirname "$0")/reproduction_cells.py" "$OUT/results.json" \
      'mlp-sgd-(?P<clients>\d+)clients-(?P<comms>\d+)comms' 'clients={clients},comms={comms},method={label}' |
    while IFS=$'\t' read -r cell dirs; do
    # shellcheck disable=SC2086
    fedfuse results record --table fedma-clients --cell "$cell" --commit "$COMMIT" $dirs
  done
done
