#!/bin/bash
# Record the runs of `fedfuse reproduce fedmerge-lora --quick` (docs/lora.md, "Measured here (CPU, scaled
# down)") into one of its tables:
#   results/record-fedmerge-lora.sh [--table ID] COMMIT OUT [OUT ...]
# ID (default fedmerge-lora): fedmerge-lora (both splits, cells split=…,method=…), fedmerge-lora-roles (the
# role split's main table and --sweep rows, 5 rounds, cells method=…) or fedmerge-lora-15 (the role split at
# --rounds 15, cells method=…).  Only the row labels the table's spec lists in its "order" are recorded, so an
# OUT holding more rows (e.g. a --sweep run) can feed each table.
# COMMIT: the fedfuse commit the reproduction ran on; OUT: its --out (holding results.json, which names the
# run directories per row and seed of its table lora-roles or lora-tasks).  One `fedfuse results record` per
# cell (split, method).  The run config names a Shakespeare run only: --federation records how the clients
# were built (task split, quick sizes, rank, targets) and the sha256 of the pretrained base's weights, so that
# `fedfuse results verify` rebuilds them on the same base (fedfuse.reproduce.fedmerge_lora.rebuild).  "quick"
# is read from the run's ROUGE settings (--quick's rouge_samples / gen_tokens), not from its rounds, so that
# a --quick --rounds 15 run rebuilds the --quick clients.
set -euo pipefail
TABLE=fedmerge-lora
if [ "${1:-}" = --table ]; then TABLE=${2:?table id}; shift 2; fi
COMMIT=${1:?commit}; shift
SPEC="$(dirname "$0")/tables/$TABLE.json"
[ -f "$SPEC" ] || { echo "no table spec $SPEC" >&2; exit 1; }
for OUT in "$@"; do
  python3 - "$OUT/results.json" "$SPEC" <<'PY' | while IFS=$'\t' read -r cell fed dirs; do
import json, sys
from fedfuse.reproduce.fedmerge_lora import base_state_sha256, record_federation, settings
from fedfuse.result import load

spec = json.load(open(sys.argv[2]))
split_key = "split" in spec["rows"]  # fedmerge-lora: cells split=…,method=…; the role tables: method=…
wanted = spec["order"]["method"]
for tid, t in json.load(open(sys.argv[1])).items():
    if tid not in ("lora-roles", "lora-tasks"):
        continue
    task = tid.split("-")[1]
    if not split_key and task != "roles":
        continue
    for label, runs in t["runs"].items():
        if label not in wanted:
            continue
        cfg = load(runs[0]["dir"]).config
        opts = cfg.algorithm_options
        q = settings(True, task)
        quick = (opts["rouge_samples"], opts["gen_tokens"]) == (q["rouge_samples"], q["gen_tokens"])
        fed = record_federation(task, quick=quick, rank=int(opts["rank"]), targets=",".join(opts["targets"]),
                                base_sha=base_state_sha256(str(opts["base"]).removeprefix("fedfuse:")))
        cell = f"split={task},method={label}" if split_key else f"method={label}"
        print(f"{cell}\t{json.dumps(fed)}\t" + " ".join(r["dir"] for r in runs))
PY
    # shellcheck disable=SC2086
    fedfuse results record --table "$TABLE" --cell "$cell" --commit "$COMMIT" --federation "$fed" $dirs
  done
done
