"""Every tool of `kvtrace mcp`, called with the SDK's client over stdio on a real store.

A tool with a CLI twin returns the JSON the twin prints with `--json` (wrapped
in an object where the CLI prints a list, each step with its `paged`); the
tools that change the store run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvtrace import RunPausedError, open_store
from tests.agent_runs import record_calc_run
from tests.mcp.conftest import cli, unpaged


@pytest.fixture
def calc(sqlite_url, name):
    """A recorded three-step run (model call, tool call, model call) on the SQLite store."""
    with open_store(sqlite_url) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    return name


def _json(capsys, url, *argv):
    code, out, err = cli(capsys, url, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# -- reading (SQLite) -------------------------------------------------------------------


def test_list_runs_is_the_runs_command_json(sqlite_client, sqlite_url, calc, capsys):
    listed = sqlite_client.call("list_runs")
    assert listed == {"runs": _json(capsys, sqlite_url, "runs")}
    assert {"name": calc, "depth": 3}.items() <= next(
        r for r in listed["runs"] if r["name"] == calc).items()


def test_log_is_the_log_command_json_newest_first(sqlite_client, sqlite_url, calc, capsys):
    logged = sqlite_client.call("log", run=calc)
    assert unpaged(logged["steps"]) == _json(capsys, sqlite_url, "log", calc)
    assert [s["depth"] for s in logged["steps"]] == [3, 2, 1]
    assert logged["remaining_steps"] == 0 and logged["next"] is None
    assert all(s["paged"] == {} for s in logged["steps"])


def test_log_with_a_limit_says_how_many_older_steps_remain_and_where_to_go_on(
        sqlite_client, calc):
    first = sqlite_client.call("log", run=calc, limit=2)
    assert [s["depth"] for s in first["steps"]] == [3, 2]
    assert first["remaining_steps"] == 1 and first["next"] == first["steps"][-1]["parent_id"]
    rest = sqlite_client.call("log", run=first["next"], limit=2)
    assert [s["depth"] for s in rest["steps"]] == [1]
    assert rest["remaining_steps"] == 0 and rest["next"] is None


def test_log_graph_names_the_runs_at_each_step_and_the_branches_leaving_it(
        sqlite_client, sqlite_url, calc):
    with open_store(sqlite_url) as store:
        store.fork(f"{calc}@2", f"{calc}-side").record_note("a side road")
    rows = sqlite_client.call("log", run=calc, graph=True)["steps"]
    assert [r["depth"] for r in rows] == [3, 2, 1]
    assert rows[0]["heads"] == [calc]
    assert rows[1]["num_branches"] == 1 and rows[1]["branch_runs"] == [f"{calc}-side"]


def test_show_step_is_the_show_command_json_with_its_notes(sqlite_client, sqlite_url, calc,
                                                           capsys):
    with open_store(sqlite_url) as store:
        store.note(f"{calc}@2", "checked", author="me")
    shown = sqlite_client.call("show_step", spec=f"{calc}@2")
    assert shown["paged"] == {}
    assert unpaged(shown) == _json(capsys, sqlite_url, "show", f"{calc}@2")
    assert shown["content"]["result"] == "391" and shown["notes"][0]["text"] == "checked"
    by_back = sqlite_client.call("show_step", spec=f"{calc}~1")
    assert by_back["id"] == shown["id"]


def test_watch_gives_the_events_after_a_cursor_and_the_cursor_to_go_on(
        sqlite_client, sqlite_url, calc):
    everything = sqlite_client.call("watch", run=calc, cursor=0, timeout=0)
    assert [e["kind"] for e in everything["events"]] == ["moved", "step", "step", "step"]
    assert everything["events"][0]["reason"] == "create" and not everything["is_paused"]
    with open_store(sqlite_url) as store:
        assert everything["cursor"] == store.watch_cursor(calc)
        store.run(calc).record_note("one more")
    after = sqlite_client.call("watch", run=calc, cursor=everything["cursor"], timeout=5)
    [event] = after["events"]
    assert event["kind"] == "step" and event["step"]["content"] == {"text": "one more"}
    assert after["cursor"] == event["cursor"] > everything["cursor"]
    quiet = sqlite_client.call("watch", run=calc, cursor=after["cursor"], timeout=0.2)
    assert quiet["events"] == [] and quiet["cursor"] == after["cursor"]


def test_watch_hands_a_backlog_out_max_events_at_a_time_losing_none(sqlite_client, calc):
    first = sqlite_client.call("watch", run=calc, cursor=0, max_events=3)
    rest = sqlite_client.call("watch", run=calc, cursor=first["cursor"], max_events=3)
    events = first["events"] + rest["events"]
    assert [len(first["events"]), len(rest["events"])] == [3, 1]
    assert [e["kind"] for e in events] == ["moved", "step", "step", "step"]
    assert [e["step"]["depth"] for e in events[1:]] == [1, 2, 3]


def test_watch_without_a_cursor_starts_now_and_keeps_what_follows(sqlite_client, sqlite_url,
                                                                   calc):
    now = sqlite_client.call("watch", run=calc, timeout=0)
    assert now["events"] == []
    with open_store(sqlite_url) as store:
        store.run(calc).record_note("after now")
    later = sqlite_client.call("watch", run=calc, cursor=now["cursor"], timeout=5)
    assert [e["step"]["content"]["text"] for e in later["events"]] == ["after now"]


def test_watch_waits_for_an_append_made_while_it_waits(sqlite_client, sqlite_url, calc):
    now = sqlite_client.call("watch", run=calc, timeout=0)["cursor"]

    def append_later() -> None:
        time.sleep(0.5)
        with open_store(sqlite_url) as store:
            store.run(calc).record_note("while waiting")

    writer = threading.Thread(target=append_later)
    writer.start()
    started = time.monotonic()
    got = sqlite_client.call("watch", run=calc, cursor=now, timeout=30)
    waited = time.monotonic() - started
    writer.join()
    assert [e["step"]["content"]["text"] for e in got["events"]] == ["while waiting"]
    assert 0.4 < waited < 30  # it waited for the append, and did not wait out its timeout


def test_diff_is_the_diff_command_json(sqlite_client, sqlite_url, calc, capsys):
    with open_store(sqlite_url) as store:
        store.fork(f"{calc}@2", f"{calc}-edited", edit={"result": "392"})
    diffed = sqlite_client.call("diff", a=calc, b=f"{calc}-edited")
    assert unpaged(diffed) == _json(capsys, sqlite_url, "diff", calc, f"{calc}-edited")
    assert diffed["first_difference"]["position"] == 2
    assert [c["field"] for c in diffed["first_difference"]["changes"]] == ["result"]


def test_recorded_strings_come_back_as_recorded_and_the_text_is_inert(sqlite_client,
                                                                      sqlite_url, name):
    hostile = "\x1b]52;c;cm0gLXJmIH4=\x07 evil\u202e\u200bfdp.exe \x9b31m"
    with open_store(sqlite_url) as store:
        store.run(name).record_tool_call("fetch", {"url": "x"}, hostile)
    result = sqlite_client.result("show_step", spec=name)
    assert result.structured_content["content"]["result"] == hostile  # data, as recorded
    text = result.content[0].text
    assert not any(c in text for c in "\x1b\x07\u202e\u200b\x9b")
    assert json.loads(text) == result.structured_content  # the same values, escaped


# -- changing the store (SQLite and PostgreSQL) -----------------------------------------


@pytest.fixture
def job(stores, name):
    """A recorded three-step run on the module's store (each backend)."""
    with open_store(stores) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    return name


def test_note_attaches_a_note_to_a_step_and_returns_it(client, stores, job):
    noted = client.call("note", spec=f"{job}@2", text="bad result", author="supervisor")
    with open_store(stores) as store:
        [kept] = store.notes(f"{job}@2")
        assert noted == kept.to_dict() and store.head(job).depth == 3


def test_pause_refuses_the_writers_appends_until_resume(client, stores, job):
    with open_store(stores) as store:
        writer = store.run(job)
        paused = client.call("pause", run=job, reason="checking step 2")
        assert paused == store.reflog(job)[0].to_dict()
        assert paused["reason"] == "pause" and paused["message"] == "checking step 2"
        with pytest.raises(RunPausedError, match="checking step 2"):
            writer.record_note("refused")
        assert client.call("watch", run=job, timeout=0)["is_paused"] is True
        resumed = client.call("resume", run=job)
        assert resumed["reason"] == "resume"
        assert writer.record_note("goes on").depth == 4


def test_revert_moves_a_run_back_and_undo_brings_its_steps_back(client, stores, job):
    with open_store(stores) as store:
        head = store.head(job).id
        reverted = client.call("revert", run=job, to=f"{job}@1")
        assert reverted == store.reflog(job)[0].to_dict()
        assert reverted["reason"] == "revert" and store.head(job).depth == 1
        undone = client.call("undo", run=job)
        assert undone["message"] == "undo revert" and store.head(job).id == head


def test_fork_starts_a_run_at_any_step(client, stores, job):
    forked = client.call("fork", spec=f"{job}@2", new=f"{job}-b")
    with open_store(stores) as store:
        at = store.show(f"{job}@2")
        assert forked == {"run": f"{job}-b", "head": at.id, "depth": 2,
                          "forked_from": f"{job}@2", "edit_of": None}
        assert store.head(f"{job}-b").id == at.id


def test_fork_with_an_edit_starts_from_an_edited_copy_and_leaves_the_original(
        client, stores, job):
    forked = client.call("fork", spec=f"{job}@2", new=f"{job}-fixed", edit={"result": "392"})
    with open_store(stores) as store:
        original = store.show(f"{job}@2")
        copy = store.head(f"{job}-fixed")
        assert forked["edit_of"] == original.id and forked["head"] == copy.id
        assert copy.parent_id == original.parent_id and copy.content["result"] == "392"
        assert store.head(job).depth == 3 and original.content["result"] == "391"


def test_the_server_names_its_version(sqlite_client):
    """serverInfo.version is kvtrace's own (issue 41, item 13: it was empty)."""
    import kvtrace

    info = sqlite_client.initialized.server_info
    assert (info.name, info.version) == ("kvtrace", kvtrace.__version__)
