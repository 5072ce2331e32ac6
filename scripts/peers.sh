#!/usr/bin/env bash
# kvtrace against vLLM's CPU build (`make bench-peers` installs it into .venv-vllm) on the fork
# workload, both cold, the same tokens checked through vLLM's /tokenize: each number format,
# vLLM's default block size (128) and the smallest its CPU
# attention kernel takes (multiples of 32), then with one busy process per core. JSON in
# scripts/results/peers-*.json (docs/benchmarks.md quotes them).
# Usage: bash scripts/peers.sh [CASE ...]   (default: all; a case is a name below)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p scripts/results
cores=$(nproc)
declare -A cases=(
  [float32]="--dtype float32"
  [bfloat16]="--dtype bfloat16"
  [bfloat16-block32]="--dtype bfloat16 --peer-block-size 32"
  [bfloat16-contend]="--dtype bfloat16 --contend $cores"
)
names=("$@")
((${#names[@]})) || names=(float32 bfloat16 bfloat16-block32 bfloat16-contend)
for name in "${names[@]}"; do
  if [[ -z "${cases[$name]+set}" ]]; then
    echo "unknown case $name: ${!cases[*]}" >&2
    exit 2
  fi
  echo "== kvtrace bench fork --peer vllm ${cases[$name]}" >&2
  # shellcheck disable=SC2086
  .venv/bin/kvtrace bench fork --peer vllm ${cases[$name]} --json \
    | tee "scripts/results/peers-$name.json"
done
