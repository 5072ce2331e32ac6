"""Step encoding version 2: model calls store each message as its own blob.

Revision ID: 0003_message_lists
Revises: 0002_skip_pointers

The tables do not change: version-2 step bodies (see kvtrace/store/objects/encoding.py
and lists.py) fit the same `steps` and `blobs` rows, and steps written in
version 1 keep their bodies and ids and still decode. The revision exists so
that a kvtrace too old to read version-2 bodies refuses the store (it finds
an unknown revision) instead of failing on the first new step it reads.
"""

from __future__ import annotations

revision = "0003_message_lists"
down_revision = "0002_skip_pointers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Nothing to rewrite: existing steps stay as they were recorded."""


def downgrade() -> None:
    """Nothing to undo in the tables (version-2 steps then need a newer kvtrace)."""
