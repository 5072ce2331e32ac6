"""The database under the store: engines and URLs (`backend.py`), tables (`schema.py`),
and the alembic migrations that bring an older store up to date (`migrations/`)."""
