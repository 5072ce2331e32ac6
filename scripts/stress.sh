#!/usr/bin/env bash
# Long reliability runs (docs/reliability.md): concurrent, lock-step and SIGKILLed
# writer processes on a new SQLite store and, if given, a new PostgreSQL schema;
# then the hypothesis properties at 1,000 examples each. Results in scripts/results/.
# Usage: bash scripts/stress.sh [POSTGRESQL_URL]   e.g. postgresql://postgres@127.0.0.1:5432/test
set -euo pipefail
cd "$(dirname "$0")/.."
make install >/dev/null
mkdir -p scripts/results
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== stress: SQLite" >&2
.venv/bin/python -m kvtrace.bench.stress all "sqlite:///$tmp/store.db" \
  | tee scripts/results/stress-sqlite.jsonl
if [ $# -ge 1 ]; then
  schema="kvt_stress_$$"
  echo "== stress: PostgreSQL (schema $schema)" >&2
  .venv/bin/python - "$1" "$schema" create <<'PY'
import sys, sqlalchemy as sa
url = sys.argv[1].replace("postgresql://", "postgresql+psycopg://", 1)
with sa.create_engine(url).begin() as conn:
    conn.execute(sa.text(f"CREATE SCHEMA {sys.argv[2]}"))
PY
  .venv/bin/python -m kvtrace.bench.stress all "$1?options=-csearch_path%3D$schema" \
    | tee scripts/results/stress-postgresql.jsonl || status=$?
  .venv/bin/python - "$1" "$schema" <<'PY'
import sys, sqlalchemy as sa
url = sys.argv[1].replace("postgresql://", "postgresql+psycopg://", 1)
with sa.create_engine(url).begin() as conn:
    conn.execute(sa.text(f"DROP SCHEMA {sys.argv[2]} CASCADE"))
PY
  [ -z "${status:-}" ] || exit "$status"
fi
echo "== hypothesis properties, 1,000 examples each" >&2
KVTRACE_HYPOTHESIS_EXAMPLES=1000 .venv/bin/pytest -q -p no:cacheprovider \
  tests/store/test_properties.py --hypothesis-show-statistics \
  | tee scripts/results/properties.txt
