"""SDK objects as plain JSON values: what every recorder and importer stores.

Clients hand kvtrace pydantic models (the `openai` and `anthropic` packages'
types), dataclasses, tuples; the store keeps dicts and lists, so equal values
are equal bytes whatever object they came in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def to_plain(value: Any) -> Any:
    """`value` with SDK objects (pydantic models, dataclasses) turned into dicts and lists."""
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        return to_plain(dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value
