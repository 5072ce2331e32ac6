"""The tool decorator: every call of a tool function becomes a tool_call step.

    @kvtrace.tracer.tool                 # records into the current recording(...)
    def get_weather(city: str) -> str: ...

    @rec.tool                            # records into this Recorder, always
    async def search(query: str) -> list[str]: ...

    get_weather("Paris", tool_call_id=call.id)   # links the step to the model's call

What a step holds: the arguments bound to their parameter names (defaults
filled in), the result or the exception (`error` is "Type: message"; the
exception is raised on unchanged), the order of the result's keys where it
is not sorted (the store sorts them; a replay gives them back in the order
the tool returned them), the duration (`timings.duration_s`), and
`call_id` when the caller passes `tool_call_id=` (taken out before the
function is called, unless the function itself has such a parameter).
Values that are not JSON (objects of the agent's own classes) are stored as
their `repr`. Sync and async functions alike; a `kvtrace.tool` function
called outside any recording simply runs, unrecorded.

Inside `with kvtrace.replaying(run, until=K)` (replay_mode.py) the session
decides first: a call that is the recording's next tool call is answered
with its recorded result (or error) and the function does not run; any
other runs live and is recorded on the session's fork, whatever recorder
the decorator names.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtrace.apis.plain import to_plain
from kvtrace.errors import UsageError
from kvtrace.store import Step
from kvtrace.store.objects.keyorder import key_order
from kvtrace.tracer.context import current_recorder, current_replaying, served_outcome

if TYPE_CHECKING:
    from kvtrace.tracer.recorder import Recorder

CALL_ID_ARGUMENT = "tool_call_id"


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    recorder: Recorder | None = None,
) -> Any:
    """Decorate a tool function (bare `@tool` or `@tool(name=...)`); see the module docstring.

    Without `recorder`, each call records into the current recording, if any.
    """
    if function is None:
        return lambda f: tool(f, name=name, recorder=recorder)
    if not callable(function):
        raise UsageError("@tool decorates a function")
    tool_name = name or getattr(function, "__name__", None) or "tool"
    signature = inspect.signature(function)
    takes_call_id = CALL_ID_ARGUMENT in signature.parameters

    def target(arguments: dict[str, Any]) -> Recorder | Step | None:
        """Where this call goes: a recorded step that answers it, a recorder, or None."""
        session = current_replaying()
        if session is not None:
            return session.take_tool(tool_name, jsonable(arguments))
        return recorder if recorder is not None else current_recorder()

    def split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The call's arguments bound to their names, and its call id."""
        call_id = kwargs.get(CALL_ID_ARGUMENT) if takes_call_id else kwargs.pop(
            CALL_ID_ARGUMENT, None
        )
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return {"args": list(args), "kwargs": dict(kwargs)}, call_id
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if takes_call_id:
            arguments.pop(CALL_ID_ARGUMENT, None)
        return arguments, call_id

    def record(
        rec: Recorder, arguments: dict[str, Any], call_id: Any, started: float,
        result: Any = None, error: BaseException | None = None,
    ) -> None:
        returned = None if error is not None else jsonable(result)
        rec.record_tool_call(
            tool_name,
            jsonable(arguments),
            returned,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
            call_id=str(call_id) if call_id is not None else None,
            timings={"duration_s": round(time.perf_counter() - started, 6)},
            key_order=key_order(returned),
        )

    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            arguments, call_id = split(args, kwargs)
            rec = target(arguments)
            if isinstance(rec, Step):
                return served_outcome(rec)
            if rec is None:
                return await function(*args, **kwargs)
            started = time.perf_counter()
            try:
                result = await function(*args, **kwargs)
            except Exception as exc:
                record(rec, arguments, call_id, started, error=exc)
                raise
            record(rec, arguments, call_id, started, result=result)
            return result

        return async_wrapper

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        arguments, call_id = split(args, kwargs)
        rec = target(arguments)
        if isinstance(rec, Step):
            return served_outcome(rec)
        if rec is None:
            return function(*args, **kwargs)
        started = time.perf_counter()
        try:
            result = function(*args, **kwargs)
        except Exception as exc:
            record(rec, arguments, call_id, started, error=exc)
            raise
        record(rec, arguments, call_id, started, result=result)
        return result

    return wrapper


def jsonable(value: Any) -> Any:
    """`value` as JSON data: SDK objects become dicts, anything else not JSON its repr."""
    plain = to_plain(value)
    try:
        json.dumps(plain, allow_nan=False)
        return plain
    except (TypeError, ValueError):
        pass
    if isinstance(plain, dict):
        return {str(key): jsonable(item) for key, item in plain.items()}
    if isinstance(plain, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in plain]
    if isinstance(plain, bytes):
        return plain.decode("utf-8", errors="replace")
    return repr(plain)
