"""Initial schema: blobs, steps, refs, reflog, notes, and append-only triggers.

Revision ID: 0001_initial
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

APPEND_ONLY = ("blobs", "steps", "reflog", "notes")


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "steps",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
    )
    op.create_index("ix_steps_parent_id", "steps", ["parent_id"])
    op.create_table(
        "refs",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("head", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "reflog",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ref", sa.String(200), nullable=False),
        sa.Column("old_head", sa.String(64), nullable=True),
        sa.Column("new_head", sa.String(64), nullable=True),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_reflog_ref", "reflog", ["ref", "id"])
    op.create_table(
        "notes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("step_id", sa.String(64), sa.ForeignKey("steps.id"), nullable=False),
        sa.Column("author", sa.String(200), nullable=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_notes_step_id", "notes", ["step_id"])

    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            """
            CREATE FUNCTION kvtrace_reject_change() RETURNS trigger AS $$
            BEGIN
                RAISE EXCEPTION 'kvtrace: % on % rejected: the trace store is append-only',
                    TG_OP, TG_TABLE_NAME;
            END
            $$ LANGUAGE plpgsql
            """
        )
        for table in APPEND_ONLY:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION kvtrace_reject_change()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                "FOR EACH STATEMENT EXECUTE FUNCTION kvtrace_reject_change()"
            )
    else:
        for table in APPEND_ONLY:
            for action in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, 'kvtrace: {action} on {table} rejected: "
                    "the trace store is append-only'); END"
                )


def downgrade() -> None:
    for table in ("notes", "reflog", "refs", "steps", "blobs"):
        op.drop_table(table)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS kvtrace_reject_change()")
