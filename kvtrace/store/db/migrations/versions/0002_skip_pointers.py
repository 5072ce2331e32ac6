"""Skip pointers on steps (O(log n) ancestor lookup); block REPLACE on SQLite.

Revision ID: 0002_skip_pointers
Revises: 0001_initial

Adds `steps.skip_id` and `steps.skip_depth` (see kvtrace/store/objects/history.py) and
fills them for existing steps, root first. Filling them is the one UPDATE the
store ever runs on `steps`, so the append-only trigger is lifted for it inside
this migration's transaction and restored before it commits.

SQLite's `INSERT OR REPLACE` deletes the old row without firing DELETE
triggers; a BEFORE INSERT trigger now turns an insert of an existing key into
a no-op on every append-only table (the row is kept, not replaced).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from kvtrace.store.objects.history import skip_in_memory

revision = "0002_skip_pointers"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

KEYS = {"blobs": "hash", "steps": "id", "reflog": "id", "notes": "id"}
_SQLITE_NO_UPDATE = (
    "CREATE TRIGGER steps_no_update BEFORE UPDATE ON steps BEGIN SELECT RAISE(ABORT, "
    "'kvtrace: UPDATE on steps rejected: the trace store is append-only'); END"
)


def upgrade() -> None:
    op.add_column("steps", sa.Column("skip_id", sa.String(64), nullable=True))
    op.add_column("steps", sa.Column("skip_depth", sa.Integer, nullable=True))
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    rows = bind.execute(sa.text("SELECT id, parent_id, depth FROM steps ORDER BY depth")).all()
    if rows:
        if postgres:
            op.execute("ALTER TABLE steps DISABLE TRIGGER steps_append_only")
        else:
            op.execute("DROP TRIGGER steps_no_update")
        known: dict[str, tuple[str | None, int, str | None]] = {}
        updates = []
        for step_id, parent_id, depth in rows:
            skip_id, skip_depth = skip_in_memory(parent_id, depth, known.__getitem__)
            known[step_id] = (parent_id, depth, skip_id)
            if skip_id is not None:
                updates.append({"i": step_id, "s": skip_id, "d": skip_depth})
        if updates:
            bind.execute(
                sa.text("UPDATE steps SET skip_id = :s, skip_depth = :d WHERE id = :i"), updates
            )
        if postgres:
            op.execute("ALTER TABLE steps ENABLE TRIGGER steps_append_only")
        else:
            op.execute(_SQLITE_NO_UPDATE)
    if not postgres:
        for table, key in KEYS.items():
            op.execute(
                f"CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table} "
                f"WHEN EXISTS (SELECT 1 FROM {table} WHERE {key} = NEW.{key}) "
                "BEGIN SELECT RAISE(IGNORE); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        for table in KEYS:
            op.execute(f"DROP TRIGGER {table}_no_replace")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("skip_depth")
        batch.drop_column("skip_id")
