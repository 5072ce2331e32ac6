"""Benchmarks behind `kvtrace bench`: each returns one JSON-ready dict of measurements."""
