"""The three provider APIs a model call can be spoken in, and how each is stored and read.

A model call keeps its own API's shape (nothing a provider sent is lost, and
an exchange can be served back byte for byte in meaning), and every reader
sees the same call in OpenAI chat shape (docs/store.md, "Three APIs"):

| API | list field (item by item) | payload fields | normalised by |
| --- | --- | --- | --- |
| `openai-chat` | `messages` | `response`, `tools` | chat.py (stored as is) |
| `anthropic-messages` | `messages` | `response`, `request`: {`system`, `tools`} | anthropic.py |
| `openai-responses` | `input` | `response`, `request`: {`instructions`, `tools`} | responses.py |

`request` holds the parts of a request that rarely change within a run (the
system prompt and the tool list) as one blob: one address per step instead
of two keeps a step's body, the store's per-call overhead, as small as a
chat call's.

The chat view of an Anthropic or Responses call is derived on reading, by
pure functions, never stored beside it: the store keeps each conversation
once (per-message dedup), and a derivation that improves needs no
migration. Steps recorded before this module have no `api` meta key and are
chat calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvtrace.apis import anthropic, chat, responses
from kvtrace.apis.plain import to_plain
from kvtrace.errors import UsageError


class ProviderApi(StrEnum):
    """The API a model call was spoken in; its request and response keep that API's shape."""

    OPENAI_CHAT = "openai-chat"
    OPENAI_RESPONSES = "openai-responses"
    ANTHROPIC_MESSAGES = "anthropic-messages"


_MODULES = {ProviderApi.OPENAI_CHAT: chat, ProviderApi.ANTHROPIC_MESSAGES: anthropic,
            ProviderApi.OPENAI_RESPONSES: responses}


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one API's call lives in a step's content."""

    conversation: str  # the list field, stored item by item
    system: str | None  # the system prompt's key in `request`, if the API keeps it apart


LAYOUTS = {
    ProviderApi.OPENAI_CHAT: Layout("messages", None),
    ProviderApi.ANTHROPIC_MESSAGES: Layout("messages", "system"),
    ProviderApi.OPENAI_RESPONSES: Layout("input", "instructions"),
}


@dataclass(frozen=True, slots=True)
class ChatView:
    """A model call in OpenAI chat shape, whatever API it was spoken in."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    response: Any


def stored_fields(api: ProviderApi, conversation: Any, response: Any, *, tools: Any = None,
                  system: Any = None, prior: list[dict[str, Any]] | None = None,
                  ) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(payload, lists) of a model call in `api`'s shape, checked; UsageError names what is wrong.

    `prior` (Responses only) holds the items of a previous response the input
    continues, for checking that each tool output answers a call.
    """
    layout = LAYOUTS[api]
    if api is ProviderApi.OPENAI_CHAT:
        if system is not None:
            raise UsageError("system is for Anthropic and Responses calls: a chat call puts "
                             "its system prompt in messages", param="system")
        items = chat.normalize_messages(conversation)
        payload: dict[str, Any] = {"response": chat.normalize_response(response)}
        tool_list = chat.normalize_tools(tools)
    elif api is ProviderApi.ANTHROPIC_MESSAGES:
        items = anthropic.normalize_messages(conversation)
        payload = {"response": anthropic.normalize_response(response),
                   "system": anthropic.normalize_system(system)}
        tool_list = anthropic.normalize_tools(tools)
    else:
        if system is not None and not isinstance(system, str):
            raise UsageError("instructions must be a string", param="system")
        items = responses.normalize_input(conversation, prior or ())
        payload = {"response": responses.normalize_response(response), "instructions": system}
        tool_list = responses.normalize_tools(tools)
    if api is ProviderApi.OPENAI_CHAT:
        payload["tools"] = tool_list
    else:
        system_key = layout.system or ""
        request = {system_key: payload.pop(system_key), "tools": tool_list}
        payload["request"] = {k: v for k, v in request.items() if v is not None} or None
    return ({k: v for k, v in payload.items() if v is not None},
            {layout.conversation: items})


def request_params(api: ProviderApi, request: Mapping[str, Any]) -> dict[str, Any]:
    """A request's parameters (sampling, tool choice, metadata...): every field but those
    its API's module lists in `NOT_PARAMS`, one list per API for every recording path."""
    skipped = _MODULES[api].NOT_PARAMS
    return {key: value for key, value in request.items() if key not in skipped}


def chat_view(api: ProviderApi, content: Mapping[str, Any]) -> ChatView:
    """The call stored in `content` as OpenAI chat (see the module docstring)."""
    return ChatView(view_messages(api, content), chat_tools(api, content),
                    chat_response(api, content))


def view_messages(api: ProviderApi, content: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of the call stored in `content`, as OpenAI chat messages (copies)."""
    layout = LAYOUTS[api]
    items = content.get(layout.conversation)
    items = [dict(m) for m in items] if isinstance(items, list) else []
    if api is ProviderApi.OPENAI_CHAT:
        return items
    system = native_request(api, content).get(layout.system) if layout.system else None
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return anthropic.to_chat(system, items)
    return responses.to_chat(system, items)


def chat_tools(api: ProviderApi, content: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tool list of the call stored in `content`, in OpenAI chat shape (None for none).

    Read apart from the conversation: a reader of a long run's responses or
    tools never copies each call's whole history.
    """
    tools = native_request(api, content).get("tools")
    tools = [dict(t) for t in tools] if isinstance(tools, list) and tools else None
    if api is ProviderApi.OPENAI_CHAT:
        return tools
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return anthropic.chat_tools(tools)
    return responses.chat_tools(tools)


def chat_response(api: ProviderApi, content: Mapping[str, Any]) -> Any:
    """The response of the call stored in `content`, in OpenAI chat shape."""
    response = content.get("response")
    if api is ProviderApi.OPENAI_CHAT or not isinstance(response, Mapping):
        return response
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return anthropic.chat_response(response)
    return responses.chat_response(response)


def native_request(api: ProviderApi, content: Mapping[str, Any]) -> dict[str, Any]:
    """The system prompt (Anthropic `system`, Responses `instructions`) and `tools` of a call."""
    if api is ProviderApi.OPENAI_CHAT:
        return {"tools": content["tools"]} if "tools" in content else {}
    request = content.get("request")
    return dict(request) if isinstance(request, Mapping) else {}


def finish_reason(api: ProviderApi, response: Mapping[str, Any]) -> str | None:
    """A stored native response's end in OpenAI chat's finish_reason vocabulary."""
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return anthropic.finish_reason(response)
    if api is ProviderApi.OPENAI_RESPONSES:
        return responses.finish_reason(response)
    return None


def edit_normalizers(api: ProviderApi) -> dict[str, Callable[[Any], Any]]:
    """How each editable field of a model call in `api` is normalised.

    The fields are the call's own: `request`'s parts (`system` or
    `instructions`, `tools`) are edited by their names (edits.py puts them
    back into `request`).
    """
    if api is ProviderApi.ANTHROPIC_MESSAGES:
        return {"messages": anthropic.normalize_messages, "response": anthropic.normalize_response,
                "tools": anthropic.normalize_tools, "system": anthropic.normalize_system}
    if api is ProviderApi.OPENAI_RESPONSES:
        return {"input": responses.normalize_input, "response": responses.normalize_response,
                "tools": responses.normalize_tools, "instructions": _instructions}
    return {"messages": chat.normalize_messages, "response": chat.normalize_response,
            "tools": chat.normalize_tools}


def _instructions(value: Any) -> str | None:
    plain = to_plain(value)
    if plain is not None and not isinstance(plain, str):
        raise UsageError("instructions must be a string")
    return plain or None
