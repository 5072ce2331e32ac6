"""MCP's `list_runs(verdict=)`: a supervisor finds the runs that passed or failed, through the
SDK's client over stdio (issue 43, item 4)."""

from __future__ import annotations

from kvtrace import open_store
from kvtrace.workspace.verdicts import Verdict, record_verdict


def test_list_runs_filters_by_the_latest_verdict(sqlite_client, sqlite_url, name):
    with open_store(sqlite_url) as store:
        for suffix, code in (("good", 0), ("bad", 1), ("plain", None)):
            run = f"{name}-{suffix}"
            store.run(run).record_note("did the work")
            if code is not None:
                record_verdict(store, run, Verdict("make test", code, 0.5, "out\n"))
    ours = {f"{name}-{s}" for s in ("good", "bad", "plain")}
    passed = [r for r in sqlite_client.call("list_runs", verdict="passed")["runs"]
              if r["name"] in ours]
    assert [(r["name"], r["verdict"]) for r in passed] == [(f"{name}-good", "passed")]
    failed = [r["name"] for r in sqlite_client.call("list_runs", verdict="failed")["runs"]
              if r["name"] in ours]
    assert failed == [f"{name}-bad"]
    none = [r["name"] for r in sqlite_client.call("list_runs", verdict="none")["runs"]
            if r["name"] in ours]
    assert none == [f"{name}-plain"]
    every = {r["name"] for r in sqlite_client.call("list_runs")["runs"]}
    assert ours <= every
