"""`kvtrace import/export --format`: round trips through files; one-line errors change nothing."""

from __future__ import annotations

import json

import pytest

from kvtrace.cli import main
from tests.formats.conftest import DATA


@pytest.fixture
def kv(store_url, capsys):
    """Run `kvtrace --store URL ARGS...`: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", store_url, *argv])
        out, err = capsys.readouterr()
        return int(exit_info.value.code or 0), out, err

    return run


@pytest.mark.parametrize(("name", "fmt"), [("atif_v1_7_parts.json", "atif"),
                                            ("atif_v1_0_terminal.json", "atif"),
                                            ("openai_mini_swe_agent_v2.json", "openai")])
def test_import_then_export_to_a_file_gives_back_the_document(kv, tmp_path, name, fmt):
    code, out, _ = kv("import", "--format", fmt, str(DATA / name), "--run", "t")
    assert code == 0 and out.startswith("imported t (")
    target = tmp_path / "back.json"
    assert kv("export", "t", "--format", fmt, "-o", str(target))[0] == 0
    assert json.loads(target.read_text()) == json.loads((DATA / name).read_text())


def test_export_without_a_file_prints_the_document(kv):
    kv("import", "-f", "openai", str(DATA / "openai_mini_swe_agent_v2.json"))
    code, out, _ = kv("export", "openai_mini_swe_agent_v2", "--format", "openai")
    assert code == 0
    assert json.loads(out) == json.loads((DATA / "openai_mini_swe_agent_v2.json").read_text())


def test_the_run_is_named_after_the_file_by_default(kv):
    kv("import", "--format", "atif", str(DATA / "atif_v1_4_tools.json"))
    runs = json.loads(kv("runs", "--json")[1])
    assert [(r["name"], r["depth"]) for r in runs] == [("atif_v1_4_tools", 6)]


def test_an_imported_run_exports_in_the_other_format_and_as_a_bundle(kv, tmp_path):
    kv("import", "--format", "atif", str(DATA / "atif_v1_4_tools.json"), "--run", "shop")
    code, out, _ = kv("export", "shop@4", "--format", "openai")
    messages = json.loads(out)["messages"]
    assert code == 0 and [m["role"] for m in messages] == [
        "system", "user", "assistant", "tool", "tool", "assistant"]
    bundle = tmp_path / "shop.kvtrace"
    assert kv("export", "shop", "-o", str(bundle))[0] == 0  # bundle stays the default
    assert kv("import", str(bundle), "--as", "copy")[0] == 0
    heads = {r["name"]: r["head_id"] for r in json.loads(kv("runs", "--json")[1])}
    assert heads["copy"] == heads["shop"]


def _bad_files(tmp_path):
    atif = json.loads((DATA / "atif_v1_4_tools.json").read_text())
    unknown_call = json.loads(json.dumps(atif))
    unknown_call["steps"][2]["observation"]["results"][1]["source_call_id"] = "nope"
    header = b'{"format": "kvtrace-bundle", "version": 2, "run": "x", "head": null}\n'
    deep, digits = b"[" * 5000 + b"]" * 5000, b'{"n": ' + b"9" * 5000 + b"}"
    same_id = [{"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
               for name in ("f", "g")]
    duplicate = [{"role": "user", "content": "go"},
                 {"role": "assistant", "content": None, "tool_calls": same_id},
                 {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                 {"role": "assistant", "content": "done"}]
    files = {
        "duplicate-ids.json": ("openai", json.dumps(duplicate).encode(),
                               "messages[1].tool_calls[1]: id 'c1' is used twice"),
        "content-5.json": ("openai", b'[{"role": "user", "content": 5}]',
                           "messages[0].content must be a string, null or a list"),
        "not-json.json": ("atif", b"{\"schema_version\": \"ATIF-v1.4\",", "is not JSON"),
        "deep.json": ("openai", deep, "deep.json is nested more than 256 levels deep"),
        "deep-otel.json": ("otel", deep, "is nested more than 256 levels deep"),
        "digits.json": ("atif", digits, "digits.json holds a number of more than 4300 digits"),
        "deep.kvtrace": ("bundle", header + deep, "line 2 is nested more than 256 levels"),
        "digits.kvtrace": ("bundle", header + digits, "line 2 holds a number of more than"),
        "not-utf8.json": ("openai", b"[\xff]", "is not UTF-8"),
        "nan.json": ("openai", b"[{\"role\": \"user\", \"content\": NaN}]", "NaN is not JSON"),
        "shape.json": ("openai", b"{\"chat\": []}", "messages: missing"),
        "v2.json": ("atif", json.dumps({**atif, "schema_version": "ATIF-v2.0"}).encode(),
                    "schema_version is 'ATIF-v2.0'"),
        "unknown-call.json": ("atif", json.dumps(unknown_call).encode(),
                              "steps[2].observation.results[1]: source_call_id 'nope'"),
    }
    for name, (_, data, _) in files.items():
        (tmp_path / name).write_bytes(data)
    return files


def test_bad_files_are_one_error_line_exit_2_and_change_nothing(kv, tmp_path):
    kv("import", "--format", "openai", str(DATA / "openai_tau_airline.json"), "--run", "tau")
    before = kv("runs", "--json")[1], kv("fsck", "--json")[1]
    for name, (fmt, _, message) in _bad_files(tmp_path).items():
        code, out, err = kv("import", "--format", fmt, str(tmp_path / name), "--run", "bad")
        assert code == 2 and out == "", name
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    code, _, err = kv("import", "--format", "atif", str(DATA / "atif_v1_0_terminal.json"),
                      "--run", "tau")
    assert code == 2 and "run 'tau' exists" in err
    assert (kv("runs", "--json")[1], kv("fsck", "--json")[1]) == before


def test_an_unknown_format_is_a_usage_error(kv):
    code, _, err = kv("import", "--format", "csv", str(DATA / "atif_v1_4_tools.json"))
    assert code == 2 and err.startswith("error: ") and "csv" in err


@pytest.mark.slow
def test_an_imported_trajectory_analyzes_with_the_provider_cached_tokens(kv):
    kv("import", "--format", "atif", str(DATA / "atif_v1_4_tools.json"), "--run", "shop")
    code, out, err = kv("analyze", "shop", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["total"]["steps"] == 3 and result["total"]["breakers"] == 0
    assert [s["provider_cached_tokens"] for s in result["steps"]] == [512, 640, 704]


def test_a_file_name_that_is_no_run_name_asks_for_one(kv, tmp_path):
    odd = tmp_path / "my trace.json"
    odd.write_bytes((DATA / "atif_v1_0_terminal.json").read_bytes())
    code, _, err = kv("import", "--format", "atif", str(odd))
    assert code == 2 and "--run NAME" in err and err.count("\n") == 1
    assert kv("import", "--format", "atif", str(odd), "--run", "my-trace")[0] == 0


def test_a_recorded_run_with_a_tool_result_answering_no_call_exports_and_imports_back(
        kv, store_url, tmp_path):
    from kvtrace import open_store

    with open_store(store_url) as store:  # as the server records a client's trimmed history
        store.run("served").record_model_call(
            [{"role": "user", "content": "and then?"},
             {"role": "tool", "tool_call_id": "call_gone", "content": "42"}],
            "It was 42.", model="m")
    for fmt in ("openai", "atif"):
        target = tmp_path / f"served.{fmt}.json"
        assert kv("export", "served", "--format", fmt, "-o", str(target))[0] == 0
        code, out, err = kv("import", "--format", fmt, str(target), "--run", f"back-{fmt}")
        assert (code, err) == (0, "") and out.startswith(f"imported back-{fmt} (1 steps)")
