"""A step's content with some fields replaced, normalised as recording them would.

A fork with an edit (`Store.fork(..., edit=...)`) copies a step with new
values for some of its fields. The new values go through the same
normalisers as a recording, chosen by the step's kind and, for a model
call, by the API it was spoken in, so an edited step is stored exactly as
the same call recorded live would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtrace.store.apis import edit_normalizers
from kvtrace.store.kinds import ModelCall, StepKind
from kvtrace.store.plain import to_plain
from kvtrace.store.records import Step


def edited_content(step: Step, edit: Mapping[str, Any]) -> dict[str, Any]:
    """`step`'s content with the fields of `edit` replaced, each normalised."""
    normalizers = (edit_normalizers(ModelCall(step).api)
                   if step.kind == StepKind.MODEL_CALL else {})
    out = dict(step.content)
    for key, value in edit.items():
        out[key] = normalizers.get(key, to_plain)(value)
    return out


def editable_fields(step: Step) -> set[str]:
    """The fields an edit may name: the step's own, and a model call's optional ones."""
    optional = set(edit_normalizers(ModelCall(step).api)) if (
        step.kind == StepKind.MODEL_CALL) else set()
    return set(step.content) | optional
