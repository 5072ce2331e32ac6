"""`python -m kvtrace` is the `kvtrace` command."""

from kvtrace.cli import main

main()
