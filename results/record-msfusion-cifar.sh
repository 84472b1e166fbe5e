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
python3 - "$OUT/results.json" <<'PY' | while IFS=$'\t' read -r cell dirs; do
import json, re, sys
for tid, t in json.load(open(sys.argv[1])).items():
    m = re.fullmatch(r"cifar-non-iid-mu([0-9.]+)", tid)
    if not m:
        continue
    for label, runs in t["runs"].items():
        print(f"method={label},mu={m[1]}\t" + " ".join(r["dir"] for r in runs))
PY
  # shellcheck disable=SC2086
  fedfuse results record --table msfusion-cifar40 --cell "$cell" --commit "$COMMIT" $dirs
done
