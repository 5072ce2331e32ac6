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

from kvtrace.apis import LAYOUTS, ProviderApi, edit_normalizers, native_request
from kvtrace.apis.plain import to_plain
from kvtrace.store.kinds import ModelCall, StepKind
from kvtrace.store.records import Step


def edited_content(step: Step, edit: Mapping[str, Any]) -> dict[str, Any]:
    """`step`'s content with the fields of `edit` replaced, each normalised.

    An Anthropic or Responses call keeps its system prompt and tools in one
    `request` field (apis.py): an edit names them, and they go back there.
    """
    out = dict(step.content)
    if step.kind != StepKind.MODEL_CALL:
        out.update({key: to_plain(value) for key, value in edit.items()})
        return out
    api = ModelCall(step).api
    normalizers = edit_normalizers(api)
    request = None if api is ProviderApi.OPENAI_CHAT else dict(native_request(api, out))
    for key, value in edit.items():
        new = normalizers.get(key, to_plain)(value)
        if request is not None and key in ("tools", LAYOUTS[api].system):
            request[key] = new
        else:
            out[key] = new
    if request is not None:
        request = {k: v for k, v in request.items() if v is not None}
        if request:
            out["request"] = request
        else:
            out.pop("request", None)
    return out


def editable_fields(step: Step) -> set[str]:
    """The fields an edit may name: the step's own, and a model call's optional ones."""
    if step.kind != StepKind.MODEL_CALL:
        return set(step.content)
    return (set(step.content) - {"request"}) | set(edit_normalizers(ModelCall(step).api))
