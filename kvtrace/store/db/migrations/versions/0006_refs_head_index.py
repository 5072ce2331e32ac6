"""An index on the head of each ref: which runs point at a step, in one probe.

Revision ID: 0006_refs_head_index
Revises: 0005_blob_codecs

`log --graph` names the runs whose head is each step it shows, and the runs
that take each branch leaving it. Without this index it read every ref of
the store to find them, so a page of one run's graph cost more with every
run recorded (10,000 runs: a scan of 10,000 refs joined to their steps).
With it, finding the runs at a set of steps is one index probe per step.
Nothing is rewritten.
"""

from __future__ import annotations

from alembic import op

revision = "0006_refs_head_index"
down_revision = "0005_blob_codecs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_refs_head", "refs", ["head"])


def downgrade() -> None:
    op.drop_index("ix_refs_head", table_name="refs")
