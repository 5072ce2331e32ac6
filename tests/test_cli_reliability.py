"""The CLI under bad input and failure: one line, the right exit code, nothing
created or clobbered (issue 11, items 2, 4, 6, 10, 12)."""

from __future__ import annotations

import io
import json
import sqlite3
import uuid

import pytest
import sqlalchemy as sa

from kvtrace import open_store
from kvtrace.cli import main
from kvtrace.cli.app import app
from tests.conftest import PG_URL


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    monkeypatch.delenv("KVTRACE_DEBUG", raising=False)
    store = open_store()
    run = store.run("main")
    for i in range(4):
        run.record_tool_call("calc", {"x": i}, i + 1)
    store.close()
    return tmp_path


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """A working folder with no store in it."""
    monkeypatch.setenv("KVTRACE_HOME", str(tmp_path / "empty-home"))
    monkeypatch.delenv("KVTRACE_STORE", raising=False)
    return tmp_path / "empty-home"


def kv(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _one_error_line(err: str) -> bool:
    return err.startswith("error: ") and err.count("\n") == 1


# -- item 2: export never touches a file of the user's --------------------------------


def test_a_failed_export_leaves_the_users_tmp_file_alone(home, capsys, tmp_path):
    mine = tmp_path / "out.kvtrace.tmp"
    mine.write_text("my notes")
    code, _, err = kv(capsys, "export", "nosuchrun", "-o", str(tmp_path / "out.kvtrace"))
    assert code == 2 and _one_error_line(err)
    assert mine.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out.kvtrace.tmp"]


def test_a_successful_export_leaves_the_users_tmp_file_alone(home, capsys, tmp_path):
    mine = tmp_path / "out.kvtrace.tmp"
    mine.write_text("my notes")
    assert kv(capsys, "export", "main", "-o", str(tmp_path / "out.kvtrace"))[0] == 0
    assert mine.read_text() == "my notes"
    assert (tmp_path / "out.kvtrace").read_bytes().startswith(b'{"format": "kvtrace-bundle"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out.kvtrace", "out.kvtrace.tmp"]


# -- item 4: only init, recording and a successful import create a store ---------------


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "nosuchrun"],
        ["analyze", "nosuchrun"],
        ["checkout", "nosuchrun"],
        ["continue", "nosuchrun", "--steps", "1"],
        ["log", "main"],
        ["reflog", "--all"],
    ],
)
def test_commands_that_fail_fast_create_no_store(nowhere, capsys, argv):
    code, _, err = kv(capsys, *argv)
    assert code == 2 and _one_error_line(err) and "kvtrace init" in err
    assert not nowhere.exists()


def test_a_refused_import_creates_no_store(nowhere, capsys, tmp_path):
    bad = tmp_path / "bad.kvtrace"
    bad.write_text('{"format": "kvtrace-bundle", "version": 1, "run": "x", "head": null}\n'
                   '{"blob": "00", "data": "AA=="}\n')
    code, _, err = kv(capsys, "import", str(bad))
    assert code == 2 and _one_error_line(err)
    assert not nowhere.exists()


def test_a_good_import_creates_the_store(home, nowhere, capsys, tmp_path):
    bundle = tmp_path / "main.kvtrace"
    with open_store(f"sqlite:///{home / 'home' / 'store.db'}") as source, bundle.open("wb") as f:
        source.export_run("main", f)
    assert kv(capsys, "import", str(bundle))[0] == 0
    assert (nowhere / "store.db").is_file()
    assert kv(capsys, "fsck")[0] == 0


def test_init_refuses_a_sqlite_file_with_other_tables_without_force(nowhere, capsys):
    nowhere.mkdir()
    with sqlite3.connect(nowhere / "store.db") as conn:
        conn.execute("CREATE TABLE customers (id INTEGER)")
    code, _, err = kv(capsys, "init")
    assert code == 2 and _one_error_line(err) and "--force" in err and "customers" in err
    with sqlite3.connect(nowhere / "store.db") as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert names == {"customers"}
    assert kv(capsys, "init", "--force")[0] == 0
    assert kv(capsys, "runs")[0] == 0


@pytest.fixture
def pg_schema(pg_available):
    if not pg_available:
        pytest.skip("PostgreSQL not reachable")
    schema = f"kvt_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    yield schema, f"{PG_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def _pg_tables(schema: str) -> set[str]:
    engine = sa.create_engine(PG_URL)
    try:
        return set(sa.inspect(engine).get_table_names(schema=schema))
    finally:
        engine.dispose()


def test_failing_commands_leave_an_empty_postgresql_schema_empty(pg_schema, capsys, tmp_path):
    schema, url = pg_schema
    for argv in (["replay", "nosuchrun"], ["analyze", "x"], ["log", "x"]):
        code, _, err = kv(capsys, "--store", url, *argv)
        assert code == 2 and "kvtrace init" in err
    bad = tmp_path / "bad.kvtrace"
    bad.write_text("not a bundle\n")
    assert kv(capsys, "--store", url, "import", str(bad))[0] == 2
    assert _pg_tables(schema) == set()


def test_init_refuses_a_postgresql_schema_with_other_tables(pg_schema, capsys):
    schema, url = pg_schema
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id int)"))
    engine.dispose()
    code, _, err = kv(capsys, "--store", url, "init")
    assert code == 2 and "--force" in err and "orders" in err
    assert _pg_tables(schema) == {"orders"}
    assert kv(capsys, "--store", url, "init", "--force")[0] == 0
    assert "refs" in _pg_tables(schema)


# -- item 6: one line, exit 2 for bad input; exit 1 for a bug ---------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "main@" + "9" * 5000],
        ["show", "main~" + "9" * 5000],
        ["log", "main", "-n", "0"],
        ["bench", "store", "--appends", "0"],
        ["reflog"],
        ["reflog", "main", "--all"],
        ["fork", "main", "ma\u202ein"],
        ["reset", "nosuchrun"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(home, capsys, argv):
    before = kv(capsys, "reflog", "--all", "--json")[1]
    code, _, err = kv(capsys, *argv)
    assert code == 2 and _one_error_line(err), err
    assert kv(capsys, "reflog", "--all", "--json")[1] == before


def test_a_huge_log_limit_shows_everything(home, capsys):
    code, out, _ = kv(capsys, "log", "main", "-n", "99999999999999999999", "--json")
    assert code == 0 and len(json.loads(out)) == 4


def test_a_bundle_note_with_a_lone_surrogate_is_one_line_exit_2(home, capsys, tmp_path):
    bundle = tmp_path / "main.kvtrace"
    kv(capsys, "note", "main@1", "fine")
    assert kv(capsys, "export", "main", "-o", str(bundle))[0] == 0
    lines = bundle.read_text().splitlines()
    lines = [line.replace('"fine"', '"\\ud800"') for line in lines]
    bundle.write_text("\n".join(lines) + "\n")
    code, _, err = kv(capsys, "import", str(bundle), "--as", "copy")
    assert code == 2 and _one_error_line(err) and "surrogate" in err


@pytest.fixture
def buggy_command():
    """A command with a bug, registered for one test, to reach the last line of defence."""

    def explode() -> None:
        raise ZeroDivisionError("boom\nsecond line")

    app.command("explode", hidden=True)(explode)
    yield
    app.registered_commands.pop()


def test_an_unexpected_exception_is_one_line_naming_its_type_and_exit_1(
    home, capsys, buggy_command
):
    code, out, err = kv(capsys, "explode")
    assert code == 1 and out == "" and _one_error_line(err)
    assert "ZeroDivisionError" in err and "boom second line" in err


# -- item 10: the reflog of every run, and restoring a deleted one -------------------------


def test_a_deleted_run_is_listed_by_reflog_all_and_restored_by_reset(home, capsys):
    store = open_store()
    head = store.head("main").id
    with store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM refs WHERE name = 'main'"))
    store.close()
    assert kv(capsys, "fsck")[0] == 1
    code, out, _ = kv(capsys, "reflog", "--all")
    assert code == 0 and "main" in out and head[:12] in out
    code, out, _ = kv(capsys, "reset", "main")
    assert code == 0 and head[:12] in out
    assert kv(capsys, "fsck")[0] == 0


# -- item 12: durability is a choice in the URL ---------------------------------------------


@pytest.mark.parametrize(("value", "pragma"), [(None, 1), ("normal", 1), ("full", 2), ("extra", 3)])
def test_sqlite_durability_is_chosen_in_the_url(tmp_path, value, pragma):
    url = f"sqlite:///{tmp_path / 'store.db'}" + (f"?synchronous={value}" if value else "")
    with open_store(url) as store:
        store.run("main").record_tool_call("t", {}, 1)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == pragma
        assert store.fsck().is_ok
    assert (tmp_path / "store.db").is_file() and len(list(tmp_path.iterdir())) <= 3


def test_synchronous_off_is_refused(tmp_path):
    from kvtrace.errors import StoreError

    with pytest.raises(StoreError, match="synchronous='off'"):
        open_store(f"sqlite:///{tmp_path / 'store.db'}?synchronous=off")


def test_import_into_checks_on_a_scratch_store_then_creates_the_store(tmp_path):
    from kvtrace.errors import IntegrityError, UsageError
    from kvtrace.store import import_into

    with open_store(f"sqlite:///{tmp_path / 'a.db'}") as source:
        source.run("main").record_tool_call("t", {}, 1)
        buffer = io.BytesIO()
        source.export_run("main", buffer)
    data = buffer.getvalue()
    info = import_into(f"sqlite:///{tmp_path / 'b.db'}",
                       lambda store: store.import_bundle(io.BytesIO(data)))
    assert info.name == "main" and info.depth == 1
    broken = data.replace(b'"blob"', b'"blob"', 1)[:-40] + b"\n"
    with pytest.raises((IntegrityError, UsageError)):
        import_into(f"sqlite:///{tmp_path / 'c.db'}",
                    lambda store: store.import_bundle(io.BytesIO(broken)))
    assert not (tmp_path / "c.db").exists()
