"""Resources of `kvtrace mcp`: runs and steps by address (RUN, RUN@N, RUN~K, id), read with the
SDK's client over stdio; an unknown run or step is an error carrying the CLI's message."""

from __future__ import annotations

import json

import pytest
from mcp import MCPError

from kvtrace import open_store
from tests.agent_runs import record_calc_run
from tests.mcp.conftest import cli_error


@pytest.fixture
def calc(sqlite_url, name):
    with open_store(sqlite_url) as store:
        record_calc_run(store.run(name), question=f"What is 17 * 23? ({name})")
    return name


def test_the_templates_are_listed(sqlite_client):
    templates = sqlite_client.run(sqlite_client.session.list_resource_templates())
    assert sorted(t.uri_template for t in templates.resource_templates) == [
        "kvtrace://run/{+run}", "kvtrace://step/{+spec}{?pointer,offset,max_bytes}"]
    listed = sqlite_client.run(sqlite_client.session.list_resources())
    assert [str(r.uri) for r in listed.resources] == ["kvtrace://runs"]


def test_runs_is_the_list_runs_document(sqlite_client, calc):
    assert json.loads(sqlite_client.read("kvtrace://runs")) == sqlite_client.call("list_runs")


def test_a_run_shows_its_head_state_cursor_and_newest_steps(sqlite_client, sqlite_url, calc):
    run = json.loads(sqlite_client.read(f"kvtrace://run/{calc}"))
    with open_store(sqlite_url) as store:
        head = store.head(calc)
        assert run["cursor"] == store.watch_cursor(calc)
    assert run["run"] == calc and run["head"] == head.id and run["depth"] == 3
    assert run["is_paused"] is False and run["remaining_steps"] == 0
    assert [(s["depth"], s["kind"]) for s in run["steps"]] == [
        (3, "model_call"), (2, "tool_call"), (1, "model_call")]
    assert run["steps"][1]["summary"] == 'calc({"expr": "17 * 23"}) -> 391'


def test_a_run_name_keeps_its_slashes(sqlite_client, sqlite_url, name):
    with open_store(sqlite_url) as store:
        store.run(f"team/{name}").record_note("hi")
    assert json.loads(sqlite_client.read(f"kvtrace://run/team/{name}"))["depth"] == 1
    step = json.loads(sqlite_client.read(f"kvtrace://step/team/{name}@1"))
    assert step["content"] == {"text": "hi"}


@pytest.mark.parametrize("address", ["{run}", "{run}@3", "{run}~0", "{run}@2", "{run}~1"])
def test_a_step_by_any_address_is_the_show_step_document(sqlite_client, calc, address):
    spec = address.format(run=calc)
    read = json.loads(sqlite_client.read(f"kvtrace://step/{spec}"))
    assert read == sqlite_client.call("show_step", spec=spec)


def test_a_step_by_id_prefix_and_a_page_of_it(sqlite_client, calc):
    head = sqlite_client.call("show_step", spec=calc)
    read = json.loads(sqlite_client.read(f"kvtrace://step/{head['id'][:12]}"))
    assert read["id"] == head["id"]
    page = json.loads(sqlite_client.read(
        f"kvtrace://step/{calc}?pointer=/messages&offset=1&max_bytes=1024"))
    assert page == sqlite_client.call("show_step", spec=calc, pointer="/messages", offset=1,
                                      max_bytes=1024)
    assert page["items"][0]["role"] == "user"


def test_an_unknown_run_or_step_is_an_error_with_the_clis_message(sqlite_client, sqlite_url,
                                                                  capsys):
    with pytest.raises(MCPError) as unknown:
        sqlite_client.read("kvtrace://run/nobody")
    assert unknown.value.error.message == cli_error(capsys, sqlite_url, "log", "nobody")
    with pytest.raises(MCPError) as bad:
        sqlite_client.read("kvtrace://step/nobody@0")
    assert bad.value.error.message == cli_error(capsys, sqlite_url, "show", "nobody@0")
    with pytest.raises(MCPError, match="offset='x' is not a whole number"):
        sqlite_client.read("kvtrace://step/nobody?offset=x")
