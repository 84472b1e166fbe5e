#!/bin/bash
# Record the runs of `fedfuse reproduce fedmr` (docs/fedmr.md) into a table, one cell per (setting, method):
#   results/record-fedmr.sh TABLE COMMIT OUT [OUT ...]
# TABLE: fedmr-full (`--scale full`) or fedmr-cpu (the `cpu` preset); COMMIT: the fedfuse commit the
# reproduction ran on; OUT: its --out (holding results.json, which names every setting's run directories per
# method and seed).  Several OUTs: one invocation per setting or method group, recorded into the same table.
set -euo pipefail
TABLE=${1:?table}; COMMIT=${2:?commit}; shift 2
for OUT in "$@"; do
  python3 "$(dirname "$0")/reproduction_cells.py" "$OUT/results.json" '(?P<setting>[a-z0-9.-]+)' \
      'setting={setting},method={label}' |
    while IFS=$'\t' read -r cell dirs; do
    # shellcheck disable=SC2086
    fedfuse results record --table "$TABLE" --cell "$cell" --commit "$COMMIT" $dirs
  done
done
