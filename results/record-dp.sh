#!/bin/bash
# Record the DP-FedAvg runs of docs/privacy.md ("DP-FedAvg on MNIST split across 1,000 clients") into the table
# dp-fedavg-mnist1000:
#   results/record-dp.sh COMMIT DIR
# COMMIT: the fedfuse commit the runs ran on; DIR: the parent of the run directories, named
# eps{1,2,4,8,inf}-clip{0.1,0.5}-seed{0,1,2} (inf: dp_noise=0, clipping only) and nodp-seed{0,1,2}, as written by
#   for s in 0 1 2; do for c in 0.1 0.5; do for e in 1:1.141602 2:0.861748 4:0.651469 8:0.490015 inf:0; do
#     fedfuse run --algorithm fedavg --dataset mnist --partition iid --clients 1000 --clients-per-round 20 \
#       --rounds 15 --model mlp --set 'model_options.widths=[100]' --local-epochs 1 --batch-size 16 --lr 0.1 \
#       --eval-every 15 --threads 1 --set sampling=poisson --set dp=central --set dp_clip=$c --set dp_quantile=0.5 \
#       --set dp_noise=${e#*:} --seed $s --out DIR/eps${e%%:*}-clip$c-seed$s
#   done; done; done   # and nodp-seed$s: the same without the four dp settings
set -euo pipefail
COMMIT=${1:?commit}; DIR=${2:?dir}
for c in 0.1 0.5; do
  for e in 1 2 4 8; do
    fedfuse results record --table dp-fedavg-mnist1000 --cell "epsilon=$e,clip=$c" --commit "$COMMIT" \
      "$DIR"/eps$e-clip$c-seed{0,1,2}
  done
  fedfuse results record --table dp-fedavg-mnist1000 --cell "epsilon=clipping-only,clip=$c" \
    --commit "$COMMIT" "$DIR"/epsinf-clip$c-seed{0,1,2}
done
fedfuse results record --table dp-fedavg-mnist1000 --cell "epsilon=no-DP,clip=none" \
  --commit "$COMMIT" "$DIR"/nodp-seed{0,1,2}
