"""Large step contents come in pages, never cut silently: each page says what remains, and the
pages put together are the value as recorded. Over MCP on a real store, and the page rules on
their own (kvtrace/mcp/paging.py)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace import open_store
from kvtrace.errors import UsageError
from kvtrace.mcp.paging import Budget, json_size, read_page, step_document
from kvtrace.store.records import Step

PAGE = 4096


@pytest.fixture
def big(sqlite_url, name):
    """A model call with 300 messages of ~1 KB, one of 100 KB, and a small response."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": f"message {i} " + "é😀x" * 150} for i in range(300)]
    messages[120] = {"role": "tool", "tool_call_id": "c1", "content": "long " * 20_000}
    with open_store(sqlite_url) as store:
        step = store.run(name).record_model_call(messages, "done", model="m")
    return name, step.id, messages


def _pages(client, spec, pointer, **options):
    """Every page of a value, in order, each checked to say what remains."""
    pages, offset = [], 0
    while offset is not None:
        page = client.call("show_step", spec=spec, pointer=pointer, offset=offset, **options)
        assert page["offset"] == offset
        pages.append(page)
        offset = page["next_offset"]
    return pages


def test_a_step_too_big_for_a_page_lists_what_it_leaves_out(sqlite_client, big):
    name, step_id, messages = big
    shown = sqlite_client.call("show_step", spec=name, max_bytes=PAGE)
    assert shown["id"] == step_id and list(shown["content"]) == ["response"]
    assert shown["content"]["response"]["content"] == "done"
    paged = shown["paged"]["messages"]
    assert paged["pointer"] == "/messages" and paged["num_items"] == 300
    assert paged["num_bytes"] == len(json.dumps(messages, ensure_ascii=False,
                                                separators=(",", ":")).encode())
    assert sqlite_client.call("show_step", spec=name)["paged"] == shown["paged"]  # 64 KB too


def test_a_list_comes_in_pages_of_whole_items_that_add_up_to_it(sqlite_client, big):
    name, _, messages = big
    pages = _pages(sqlite_client, name, "/messages", max_bytes=PAGE)
    items = [item for page in pages for item in page["items"]]
    skipped = [entry for page in pages for entry in page["skipped"]]
    assert [entry["index"] for entry in skipped] == [120]  # bigger than a page: by its pointer
    assert skipped[0]["pointer"] == "/messages/120"
    assert items == messages[:120] + messages[121:]
    for page in pages:
        assert len(json.dumps(page["items"], ensure_ascii=False).encode()) <= PAGE + 600
        assert page["remaining_items"] == 300 - (page["next_offset"] or 300)
    assert pages[-1]["remaining_bytes"] == 0 and pages[-1]["next_offset"] is None
    assert pages[0]["remaining_bytes"] > pages[1]["remaining_bytes"] > 0


def test_an_item_too_big_for_a_page_is_read_as_text_by_its_pointer(sqlite_client, big):
    name, _, messages = big
    pages = _pages(sqlite_client, name, "/messages/120/content", max_bytes=PAGE)
    assert "".join(page["text"] for page in pages) == messages[120]["content"]
    assert all(page["type"] == "string" for page in pages)
    assert pages[0]["num_bytes"] == 100_000 and pages[0]["remaining_bytes"] == 100_000 - PAGE
    whole = _pages(sqlite_client, name, "/messages/120", max_bytes=PAGE)
    assert json.loads("".join(page["text"] for page in whole)) == messages[120]
    assert whole[0]["type"] == "json"


def test_text_pages_are_cut_between_characters(sqlite_client, big):
    name, _, messages = big
    pages = _pages(sqlite_client, name, "/messages/3/content", max_bytes=1024)
    assert len(pages) > 1 and "".join(p["text"] for p in pages) == messages[3]["content"]
    assert all(len(p["text"].encode()) <= 1024 for p in pages)


def test_raw_bytes_are_shown_as_the_cli_shows_them_and_read_in_pages(sqlite_client,
                                                                       sqlite_url, name):
    body = bytes(range(256)) * 40
    with open_store(sqlite_url) as store:
        store.run(name).record("http", {"url": "https://example.org"},
                               raw={"response_body": body, "request_body": b"{}"})
    shown = sqlite_client.call("show_step", spec=name)
    assert shown["content"]["response_body"] == f"<{len(body)} bytes>"
    assert shown["paged"]["response_body"] == {"pointer": "/response_body",
                                               "num_bytes": len(body), "num_items": None,
                                               "is_raw": True}
    pages = _pages(sqlite_client, name, "/response_body", max_bytes=PAGE)
    assert {p["type"] for p in pages} == {"base64"}
    assert b"".join(base64.b64decode(p["text"]) for p in pages) == body
    assert all(len(p["text"]) <= PAGE for p in pages)
    assert sqlite_client.call("show_step", spec=name, pointer="/request_body")["text"] == "{}"


def test_log_shares_one_budget_between_its_steps(sqlite_client, sqlite_url, name):
    with open_store(sqlite_url) as store:
        run = store.run(name)
        for i in range(5):
            run.record_tool_call("read", {"i": i}, "x" * 3000)
    steps = sqlite_client.call("log", run=name, max_bytes=8000)["steps"]
    kept = [s for s in steps if "result" in s["content"]]
    assert [s["depth"] for s in kept] == [5, 4]  # newest first, while the page lasts
    assert all(s["paged"]["result"]["num_bytes"] == 3002 for s in steps[2:])
    assert all("arguments" in s["content"] for s in steps)  # small fields still fit


# -- the page rules on their own ---------------------------------------------------------


def _step(**content) -> Step:
    return Step("ab" * 32, None, "tool_call", 1, {}, {}, content, 0.0)


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=3000), size=st.integers(1024, 2048))
def test_text_pages_always_put_back_the_text(text, size):
    step = _step(result=text)
    offset, parts = 0, []
    while offset is not None:
        page = read_page(step, "/result", offset, size)
        assert len(page["text"].encode("utf-8", "surrogatepass")) <= size
        assert page["remaining_bytes"] == page["num_bytes"] - offset - len(
            page["text"].encode("utf-8", "surrogatepass"))
        parts.append(page["text"])
        offset = page["next_offset"]
    assert "".join(parts) == text


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.text(max_size=700), max_size=40))
def test_list_pages_always_put_back_the_list(items):
    step = _step(result=items)
    offset, got = 0, {}
    while offset is not None:
        page = read_page(step, "/result", offset, 1024)
        end = len(items) if page["next_offset"] is None else page["next_offset"]
        assert end > offset or not items  # every page moves on
        skipped = {entry["index"] for entry in page["skipped"]}
        assert all(json_size(items[index]) > 1024 for index in skipped)
        kept = [index for index in range(offset, end) if index not in skipped]
        got.update(zip(kept, page["items"], strict=True))
        got.update({index: items[index] for index in skipped})  # each read by its pointer
        offset = page["next_offset"]
    assert [got[index] for index in range(len(items))] == items


def test_an_offset_inside_a_character_is_refused():
    step = _step(result="é" * 10)
    with pytest.raises(UsageError, match=r"^offset=1 falls inside a character") as info:
        read_page(step, "/result", 1, 1024)
    assert info.value.param == "offset"


def test_a_pointer_names_fields_with_slashes_and_tildes_escaped():
    step = _step(**{"a/b": {"c~d": [1, 2, 3]}})
    assert read_page(step, "/a~1b/c~0d", 1, 1024)["items"] == [2, 3]
    with pytest.raises(UsageError, match=r"names nothing .*: /a~1b/c~0d is a list of 3 items"):
        read_page(step, "/a~1b/c~0d/3", 0, 1024)
    with pytest.raises(UsageError, match="is not a JSON pointer"):
        read_page(step, "a~1b", 0, 1024)


def test_a_field_that_fits_is_kept_and_the_budget_goes_on_to_later_fields():
    step = _step(big="x" * 5000, small="y")
    document = step_document(step, Budget(1024))
    assert document["content"] == {"small": "y"}
    assert document["paged"] == {"big": {"pointer": "/big", "num_bytes": 5002,
                                         "num_items": None, "is_raw": False}}
