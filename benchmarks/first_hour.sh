#!/usr/bin/env bash
# A new user's first hour, timed: every README tour command and every docs/api.md example, run as written, each
# with its wall and CPU time against the time the docs state next to it (benchmarks/first_hour.py says how).
# Usage: benchmarks/first_hour.sh [WORKDIR]   (on a shared machine: nice -n 10 benchmarks/first_hour.sh DIR &)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" MPLBACKEND=Agg
exec python3 benchmarks/first_hour.py "$@"
