"""The canonical encoding: the written contract behind every id in the store.

A blob's address is the SHA-256 of its bytes. A step's id is the SHA-256 of its
*body*: the canonical JSON of ``{"v": ENCODING_VERSION, "kind", "parent",
"payload", "raw", "lists", "meta"}``. Canonical means UTF-8, keys sorted, no insignificant
whitespace, no NaN or infinity, and only JSON types (dict with str keys, list,
str, int, float, bool, None). Because the parent id is inside the body, a step
id pins its whole history, like a Git commit id; identical content under the
same parent is the same step.

The version tag ``"v"`` is part of every body, so a future encoding can never
produce an id that collides with an earlier one. Changing anything here changes
ids: tests/store/test_encoding.py pins known ids.

Versions: 1 had no ``"lists"`` field (every payload field was one blob).
Version 2 adds ``"lists"``: fields whose value is a list stored item by item,
``{FIELD: {"base": STEP_ID | null, "items": [ADDRESS, ...]}}`` (see
lists.py), so that each chat message is its own blob and a conversation's
history is stored once. Steps written in version 1
keep their bodies and ids, and both versions decode.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvtrace.errors import IntegrityError, UsageError

ENCODING_VERSION = 2
KNOWN_VERSIONS = (1, 2)
MAX_KIND_LENGTH = 64
MAX_DEPTH = 256  # containers inside containers; Python's parser recurses per level
MAX_INT_BITS = 1024
_HEX = re.compile(r"[0-9a-f]+")


# Types that need no check (exact types: a subclass takes the full path).
_PLAIN = frozenset({str, bool, type(None)})
# Built once: json.dumps builds an encoder on every call with these options.
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def _check(value: Any, trail: list[str | int], enclosing: list[int]) -> None:
    """Reject anything that has no single canonical JSON spelling.

    Also refused, so that every stored value can be read back: nesting deeper
    than MAX_DEPTH, a container inside itself, integers wider than
    MAX_INT_BITS, and mappings that are not dicts. `trail` holds the keys and
    indexes down to `value` (its path, spelled out only in an error);
    `enclosing` the ids of the containers around it.
    """
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise UsageError(
                f"{_path(trail)} is an integer of {value.bit_length()} bits: at most "
                f"{MAX_INT_BITS} bits can be recorded (store larger numbers as strings)"
            )
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError(
                f"{_path(trail)} is {value}: NaN and infinity have no canonical encoding")
        return
    if not isinstance(value, (dict, list, tuple)):
        hint = ": convert it to a dict" if isinstance(value, Mapping) else ""
        raise UsageError(
            f"{_path(trail)} is a {type(value).__name__}: only JSON values (dict, list, str, "
            f"int, float, bool, None) can be recorded{hint}"
        )
    if id(value) in enclosing:
        raise UsageError(f"{_path(trail)} contains itself: a recorded value must be a tree")
    if len(enclosing) >= MAX_DEPTH:
        raise UsageError(f"{_path(trail)} is nested more than {MAX_DEPTH} levels deep")
    enclosing.append(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise UsageError(f"{_path(trail)} has a non-string key {key!r}: use string keys")
            if type(item) not in _PLAIN:
                trail.append(key)
                _check(item, trail, enclosing)
                trail.pop()
    else:
        for index, item in enumerate(value):
            if type(item) not in _PLAIN:
                trail.append(index)
                _check(item, trail, enclosing)
                trail.pop()
    enclosing.pop()


def _path(trail: list[str | int]) -> str:
    """How an error names a place: value.messages[3].content."""
    return "value" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in trail)


def canonical_json(value: Any, *, is_checked: bool = True) -> bytes:
    """Encode a JSON value canonically (sorted keys, compact, UTF-8).

    `is_checked=False` skips the walk that refuses what JSON cannot hold
    (two thirds of the cost on a large value): for a value built by kvtrace
    from str, int and containers only, such as a workspace tree."""
    if is_checked:
        _check(value, [], [])
    text = _ENCODER.encode(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"text is not valid Unicode (a lone surrogate?): {exc.reason}") from exc


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256: the address of a blob."""
    return hashlib.sha256(data).hexdigest()


def step_body(
    *,
    kind: str,
    parent: str | None,
    payload: Mapping[str, str],
    raw: list[str],
    meta: Mapping[str, Any],
    lists: Mapping[str, Mapping[str, Any]] | None = None,
) -> bytes:
    """The canonical body of a step (the current version); its SHA-256 is the step id.

    `payload` maps field names to blob addresses; `raw` names the fields whose
    blob is raw bytes rather than canonical JSON; `lists` maps list fields to
    their entries (see lists.py).
    """
    return canonical_json(
        {
            "v": ENCODING_VERSION,
            "kind": kind,
            "parent": parent,
            "payload": dict(payload),
            "raw": sorted(raw),
            "lists": {key: dict(entry) for key, entry in (lists or {}).items()},
            "meta": dict(meta),
        }
    )


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a stored body and check it is canonical and of a known version."""
    value = _loads(body, "step body")
    if not isinstance(value, dict) or type(value.get("v")) is not int or (
        value["v"] not in KNOWN_VERSIONS
    ):
        raise IntegrityError("step body has an unknown encoding version")
    problem = _shape_problem(value)
    if problem:
        raise IntegrityError(f"step body is malformed: {problem}")
    if canonical_json(value) != body:
        raise IntegrityError("step body is not in canonical form")
    return value


def decode_json_blob(data: bytes) -> Any:
    """Parse a JSON payload blob, which must be in canonical form."""
    value = _loads(data, "a JSON payload blob")
    if canonical_json(value) != data:
        raise IntegrityError("a JSON payload blob is not in canonical form")
    return value


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: JSON, or a huge integer
        raise IntegrityError(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise UsageError(f"{what} is nested more than {MAX_DEPTH} levels deep") from exc


def is_address(value: Any) -> bool:
    """Whether `value` is a lowercase hex SHA-256."""
    return isinstance(value, str) and len(value) == 64 and _HEX.fullmatch(value) is not None


def list_entry_problem(entry: Any) -> str | None:
    """What is wrong with one list entry of a body, or None."""
    if not isinstance(entry, dict) or set(entry) != {"base", "items"}:
        return "a list needs exactly base and items"
    if entry["base"] is not None and not is_address(entry["base"]):
        return "a list's base must be a step id or null"
    if not isinstance(entry["items"], list) or not _are_addresses(entry["items"]):
        return "a list's items must be blob addresses"
    return None


def _are_addresses(values: list[Any]) -> bool:
    """`all(is_address(v) for v in values)`, with one match over them all: a long
    conversation's bodies list thousands of addresses, and every read checks them."""
    if not values:
        return True
    if set(map(type, values)) != {str} or set(map(len, values)) != {64}:
        return False
    return _HEX.fullmatch("".join(values)) is not None


def _shape_problem(value: dict[str, Any]) -> str | None:
    fields = {"v", "kind", "parent", "payload", "raw", "meta"}
    if value["v"] >= 2:
        fields.add("lists")
    if set(value) != fields:
        return "unexpected or missing fields"
    kind, payload, raw = value["kind"], value["payload"], value["raw"]
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND_LENGTH:
        return "kind must be a string of 1 to 64 characters"
    if value["parent"] is not None and not is_address(value["parent"]):
        return "parent must be a step id or null"
    if not isinstance(payload, dict) or not all(is_address(a) for a in payload.values()):
        return "payload must map field names to blob addresses"
    if not isinstance(raw, list) or not all(isinstance(f, str) for f in raw) or (
        not set(raw) <= set(payload)
    ):
        return "raw must list payload fields"
    lists = value.get("lists", {})
    if not isinstance(lists, dict) or set(lists) & set(payload):
        return "lists must be an object of fields that are not payload fields"
    for entry in lists.values():
        problem = list_entry_problem(entry)
        if problem:
            return problem
    if not isinstance(value["meta"], dict):
        return "meta must be an object"
    return None
