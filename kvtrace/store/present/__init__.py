"""What a reader is shown of the store: one line per step (summary.py) and what differs
between two runs (compare.py), shared by the CLI, the report, the UI and MCP."""
