#!/bin/bash
# Record the CIFAR-10 runs of `fedfuse reproduce msfusion --parts cifar --cifar-splits non-iid --rounds 40`
# (docs/msfusion.md, "CIFAR-10, 40 rounds, three seeds") into the table msfusion-cifar40:
#   results/record-msfusion-cifar.sh COMMIT OUT
# COMMIT: the fedfuse commit the reproduction ran on; OUT: its --out (holding results.json, which names every
# table's run directories per method and seed).  One `fedfuse results record` per cell (method, μ) of the
# non-IID tables `cifar-non-iid-mu<μ>`.
set -euo pipefail
COMMIT=${1:?commit}
OUT=${2:?out}
python3 "$(dirname "$0")/reproduction_cells.py" "$OUT/results.json" \
    'cifar-non-iid-mu(?P<mu>[0-9.]+)' 'method={label},mu={mu}' |
  while IFS=$'\t' read -r cell dirs; do
  # shellcheck disable=SC2086
  fedfuse results record --table msfusion-cifar40 --cell "$cell" --commit "$COMMIT" $dirs
done
