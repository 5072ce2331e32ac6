"""Large step contents in pages: nothing is cut silently, and every page says what is left.

A tool's result keeps step content within a byte budget (`max_bytes`, each
value counted as the UTF-8 size of its compact JSON), in one of two ways:

- A step inside a result (`show_step`, `log`, `watch`, `diff`) is
  `kvtrace show --json`'s document: its header (id, kind, depth, meta, and
  notes where the tool gives them) whole, and its content fields in order
  while they fit the budget the whole result shares. A field that does not
  fit is left out of `content` and listed under the step's `paged`: its
  size, its number of items (a list) and the JSON pointer that reads it.
  Raw bytes (an HTTP body) are shown as `<N bytes>`, as the CLI shows them,
  and listed under `paged` too.
- `read_page` reads the value a JSON pointer (RFC 6901) names inside a
  step's content: a list as whole items from item `offset`; anything else
  as text from byte `offset` of its UTF-8 text (a string as it is, raw bytes
  as they are, base64 when they are not UTF-8, any other value as its JSON
  text), cut on a character boundary. `next_offset` continues (None: nothing
  left); `remaining_bytes` and `remaining_items` say what is left. A list
  page never splits an item: one bigger than a whole page is listed under
  `skipped` with its pointer, to be read as text.

Values are returned as recorded (MCP clients are programs): nothing here
makes them inert.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from kvtrace.errors import UsageError
from kvtrace.store.records import Note, Step

DEFAULT_MAX_BYTES = 64 * 1024
MIN_MAX_BYTES = 1024
MAX_MAX_BYTES = 16 * 1024 * 1024
_INDEX = re.compile(r"0|[1-9][0-9]*")
_MAX_NAMED = 12  # keys named in an error about a pointer


def check_max_bytes(max_bytes: int) -> int:
    """`max_bytes` when it is a page size kvtrace serves, else UsageError naming it."""
    if not MIN_MAX_BYTES <= max_bytes <= MAX_MAX_BYTES:
        raise UsageError(f"max_bytes={max_bytes}: give a page size from {MIN_MAX_BYTES} to "
                         f"{MAX_MAX_BYTES} bytes", param="max_bytes")
    return max_bytes


def json_size(value: Any) -> int:
    """Bytes of `value`'s compact JSON in UTF-8: what the budget counts."""
    return len(_compact(value).encode("utf-8", "surrogatepass"))


class Budget:
    """The bytes of step content a result may still hold, spent in order."""

    def __init__(self, max_bytes: int) -> None:
        self.left = check_max_bytes(max_bytes)

    def spend(self, size: int) -> bool:
        """Take `size` bytes if they are left (True), else take nothing (False)."""
        if size > self.left:
            return False
        self.left -= size
        return True


def step_document(step: Step, budget: Budget, notes: list[Note] | None = None) -> dict[str, Any]:
    """`kvtrace show --json`'s document of `step`, its content fitted to `budget`."""
    document = step.to_dict()
    shown = document["content"]
    content: dict[str, Any] = {}
    paged: dict[str, dict[str, Any]] = {}
    for key, value in step.content.items():
        pointer = "/" + _escape(key)
        if isinstance(value, bytes):
            content[key] = shown[key]
            paged[key] = {"pointer": pointer, "num_bytes": len(value), "num_items": None,
                          "is_raw": True}
            continue
        size = json_size(value)
        if budget.spend(size):
            content[key] = value
        else:
            paged[key] = {"pointer": pointer, "num_bytes": size,
                          "num_items": len(value) if isinstance(value, list) else None,
                          "is_raw": False}
    document["content"] = content
    if notes is not None:
        document["notes"] = [note.to_dict() for note in notes]
    document["paged"] = paged
    return document


def read_page(step: Step, pointer: str, offset: int, max_bytes: int) -> dict[str, Any]:
    """One page of the value `pointer` names in `step`'s content (module docstring)."""
    check_max_bytes(max_bytes)
    value = resolve_pointer(step, pointer)
    if offset < 0:
        raise UsageError(f"offset={offset}: an offset is 0 or more", param="offset")
    page = (_list_page(value, pointer, offset, max_bytes) if isinstance(value, list)
            else _text_page(value, pointer, offset, max_bytes))
    return {"id": step.id, "pointer": pointer, **page}


def resolve_pointer(step: Step, pointer: str) -> Any:
    """The value JSON pointer `pointer` names in `step`'s content, else UsageError naming it."""
    if not pointer.startswith("/"):
        raise UsageError(f"pointer={pointer!r} is not a JSON pointer: start it with / and a "
                         f"content field ({_keys(step.content)})", param="pointer")
    value: Any = step.content
    walked = ""
    for token in pointer[1:].split("/"):
        part = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and _INDEX.fullmatch(part) and int(part) < len(value):
            value = value[int(part)]
        else:
            raise UsageError(f"pointer={pointer!r} names nothing in step {step.short_id}: "
                             f"{_inside(value, walked)}", param="pointer")
        walked += "/" + token
    return value


def _list_page(items: list[Any], pointer: str, offset: int, max_bytes: int) -> dict[str, Any]:
    if offset > len(items):
        raise UsageError(f"offset={offset} is past the end of {pointer}, which has "
                         f"{len(items)} items", param="offset")
    sizes = [json_size(item) for item in items]
    page: list[Any] = []
    skipped: list[dict[str, Any]] = []
    used, index = 0, offset
    while index < len(items):
        size = sizes[index]
        if size > max_bytes:  # never fits a page: named, to be read by its own pointer
            entry = {"index": index, "pointer": f"{pointer}/{index}", "num_bytes": size}
            size = json_size(entry)
            if used + size > max_bytes and (page or skipped):
                break
            skipped.append(entry)
        elif used + size <= max_bytes:
            page.append(items[index])
        else:
            break
        used += size
        index += 1
    return {
        "type": "list",
        "num_items": len(items),
        "num_bytes": sum(sizes) + max(len(items) - 1, 0) + 2,
        "offset": offset,
        "items": page,
        "skipped": skipped,
        "next_offset": index if index < len(items) else None,
        "remaining_items": len(items) - index,
        "remaining_bytes": sum(sizes[index:]),
    }


def _text_page(value: Any, pointer: str, offset: int, max_bytes: int) -> dict[str, Any]:
    if isinstance(value, bytes):
        data = value
        kind = "raw" if _is_utf8(value) else "base64"
    elif isinstance(value, str):
        data, kind = value.encode("utf-8", "surrogatepass"), "string"
    else:
        data, kind = _compact(value).encode("utf-8", "surrogatepass"), "json"
    if offset > len(data):
        raise UsageError(f"offset={offset} is past the end of {pointer}, which is "
                         f"{len(data)} bytes", param="offset")
    is_text = kind != "base64"
    if is_text and offset < len(data) and _is_continuation(data[offset]):
        raise UsageError(f"offset={offset} falls inside a character of {pointer}: continue "
                         "from a page's next_offset", param="offset")
    # base64 grows 3 bytes into 4: the page holds what fits in max_bytes once encoded.
    end = min(len(data), offset + (max_bytes if is_text else max_bytes // 4 * 3))
    while is_text and end < len(data) and _is_continuation(data[end]):
        end -= 1
    chunk = data[offset:end]
    return {
        "type": kind,
        "num_bytes": len(data),
        "offset": offset,
        "text": (chunk.decode("utf-8", "surrogatepass") if is_text
                 else base64.b64encode(chunk).decode("ascii")),
        "next_offset": end if end < len(data) else None,
        "remaining_bytes": len(data) - end,
    }


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _escape(key: str) -> str:
    """A key as one JSON pointer token (RFC 6901: ~ is ~0, / is ~1)."""
    return key.replace("~", "~0").replace("/", "~1")


def _is_continuation(byte: int) -> bool:
    """Whether a UTF-8 byte continues a character (10xxxxxx) rather than starting one."""
    return byte & 0xC0 == 0x80


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _inside(value: Any, walked: str) -> str:
    """What the pointer could have named where it went wrong (for its error)."""
    where = walked or "the content"
    if isinstance(value, dict):
        return f"{where} has {_keys(value)}"
    if isinstance(value, list):
        return f"{where} is a list of {len(value)} items (0 to {len(value) - 1})"
    return f"{where} is a {type(value).__name__}, with nothing inside"


def _keys(mapping: dict[str, Any]) -> str:
    names = [_escape(key) for key in mapping]
    more = f", … {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return "keys " + ", ".join(names[:_MAX_NAMED]) + more if names else "no keys"
