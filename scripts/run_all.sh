#!/usr/bin/env bash
# Run every benchmark and keep its JSON in scripts/results/ (see docs/benchmarks.md).
# Usage: bash scripts/run_all.sh [store|cache|replay|serve ...]   (default: all four)
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p scripts/results
for name in "${@:-store cache replay serve}"; do
  for bench in $name; do
    echo "== kvtrace bench $bench" >&2
    .venv/bin/kvtrace bench "$bench" --json | tee "scripts/results/$bench.json"
  done
done
