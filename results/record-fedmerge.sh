#!/bin/bash
# Record the FedMerge merge-travel runs (docs/fedmerge.md, "Merge-weight travel") from the sweep store:
#   results/record-fedmerge.sh STORE
# STORE: the --store of the sweeps (every run directory holds its config.yaml).  One `fedfuse results record`
# per table cell and commit; a cell's run directories (one per seed) are the store's directories whose
# config.yaml holds every given line; the commit a run ran on is this checkout's HEAD when its config.yaml
# was written (the runs ran from this worktree's src/).
set -euo pipefail
STORE=${1:?store}

pick() {  # run directories of STORE whose config.yaml has every line given (exact match)
  for d in "$STORE"/*/; do
    [ -f "$d/summary.json" ] || continue
    ok=1
    for line in "$@"; do grep -qxF -- "$line" "$d/config.yaml" || { ok=0; break; }; done
    if [ $ok = 1 ]; then echo "${d%/}"; fi
  done
}

record() {  # TABLE CELL LINE...
  local table=$1 cell=$2; shift 2
  local dirs; dirs=$(pick "$@")
  [ -n "$dirs" ] || { echo "no runs for $table $cell" >&2; return 0; }
  local d c
  declare -A by=()
  for d in $dirs; do
    c=$(git log -1 --format=%H --before="@$(stat -c %Y "$d/config.yaml")")
    by[$c]="${by[$c]:-} $d"
  done
  for c in "${!by[@]}"; do
    # shellcheck disable=SC2086
    fedfuse results record --table "$table" --cell "$cell" --commit "$c" ${by[$c]}
  done
}

MN=("dataset: mnist" "clients: 20" "clients_per_round: 5")
CF=("dataset: cifar10" "model: cnn-cifar" "clients: 20" "clients_per_round: 10" "rounds: 24")
for split in mnist-cluster mnist-dir mnist-cluster-45 mnist-cluster-10of20 cifar-cluster cifar-dir; do
  case $split in
    mnist-cluster)    table=fedmerge-mnist;   base=("${MN[@]}" "rounds: 15" "partition: label-cluster") ;;
    mnist-dir)        table=fedmerge-mnist;   base=("${MN[@]}" "rounds: 15" "partition: dirichlet") ;;
    mnist-cluster-45) table=fedmerge-mnist-schedule; base=("${MN[@]}" "rounds: 45" "partition: label-cluster") ;;
    mnist-cluster-10of20) table=fedmerge-mnist-schedule
                      base=("dataset: mnist" "clients: 20" "clients_per_round: 10" "rounds: 15" "partition: label-cluster") ;;
    cifar-cluster)    table=fedmerge-cifar;   base=("${CF[@]}" "partition: label-cluster") ;;
    cifar-dir)        table=fedmerge-cifar;   base=("${CF[@]}" "partition: dirichlet") ;;
  esac
  record $table "split=$split,method=fedavg" "${base[@]}" "algorithm: fedavg"
  record $table "split=$split,method=ifca" "${base[@]}" "algorithm: ifca" "  k: 5"
  record $table "split=$split,method=fedem" "${base[@]}" "algorithm: fedem" "  m: 5"
  for t in 1.25 2.5 5 10 15 20 40 45; do
    for d in 5 10; do
      label="fedmerge travel=$t"; [ $d = 5 ] || label="fedmerge d=$d travel=$t"
      record $table "split=$split,method=$label" "${base[@]}" "algorithm: fedmerge" "  d: $d" \
        "  merge_travel: $t$( [[ $t == *.* ]] || echo .0)" "  merge_step: 0.0" "  fixed_k: 0" \
        "  init: independent" "  theta_update: column_normalised" "  weights_first: false" "  prox_mu: 0.0"
    done
  done
done
