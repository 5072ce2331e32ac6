"""Every error kvtrace raises, in one hierarchy.

    KvtraceError                 base: the CLI prints its message on one line, exit 2
    ├── UsageError               the caller asked for something malformed
    │   ├── InvalidNameError     a run name breaks the ref-name rules
    │   └── InvalidSpecError     a step address (RUN, RUN@N, RUN~K, id prefix) is malformed
    ├── NotFoundError            a run, step, blob, model or bundle does not exist
    │   ├── RunNotFoundError
    │   ├── StepNotFoundError    (also: an id prefix matches more than one step)
    │   ├── StoreNotFoundError   no store at that path or URL (and the caller did not create one)
    │   └── ModelNotFoundError   a model file or folder is missing; says how to install it
    ├── ConflictError            a compare-and-swap on a ref lost: someone moved it first
    │   └── RunPausedError       the run is paused by a supervisor: appends wait for a resume
    ├── IntegrityError           stored or imported bytes do not hash to their address
    ├── StoreError               the database failed (translated from SQLAlchemy)
    │   └── RetryableError       the database aborted a transaction to resolve a deadlock or a
    │                            serialization failure (SQLSTATE 40P01, 40001); nothing was
    │                            written, and the same call may simply be made again
    ├── CacheError               the KV cache cannot serve a request
    │   └── BlockWriteError      a KV block could not be written to disk (full, read-only);
    │                            the disk tier logs it and goes on without the block
    ├── GenerationCancelledError the caller cancelled a generation (a server's client left)
    ├── ReplayError              replay or continue cannot proceed
    │   ├── MissingToolError     a continued run asked for a tool nobody registered
    │   └── BackendError         a remote OpenAI-compatible backend failed (from httpx)
    └── TracerError              recording or serving an agent's calls cannot proceed
        ├── UnrecordedRequestError  a ReplayTransport in mode "none" met a request it never saw
        │                           (only with on_unrecorded="raise": else it answers 404)
        └── RecordedToolError    a replayed tool call raises the error it raised when recorded
                                 (when that error's type is not a built-in exception)

Lower-level exceptions (SQLAlchemy, httpx, torch) are translated at the boundary
with ``raise ... from exc``, so callers catch only these. Messages say what to do
next, not just what went wrong.

Messages name the Python parameters of the call that failed, written as
``name=VALUE`` (``pass to=STEP``), never a command-line flag: an error that
is about one parameter also carries its name as ``param``, and the CLI writes
that parameter as its own flag (``pass --to STEP``).
"""

from __future__ import annotations


class KvtraceError(Exception):
    """Base of every error kvtrace raises on purpose.

    `param`: the parameter the message is about, spelled ``param=`` in it
    (None when the error is not about one parameter).
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class UsageError(KvtraceError):
    """The caller asked for something malformed; nothing was changed."""


class InvalidNameError(UsageError):
    """A run name breaks the Git ref-name rules."""


class InvalidSpecError(UsageError):
    """A step address is malformed."""


class UnsupportedModelError(UsageError):
    """A model whose cache kvtrace cannot keep; the message names the config field."""


class NotFoundError(KvtraceError):
    """Something the caller named does not exist."""


class RunNotFoundError(NotFoundError):
    """No run (branch) has that name."""


class StepNotFoundError(NotFoundError):
    """No single step matches the address (none, or an ambiguous id prefix)."""


class StoreNotFoundError(NotFoundError):
    """No kvtrace store exists where the caller looked."""


class ModelNotFoundError(NotFoundError):
    """A model file or folder is missing."""


class ConflictError(KvtraceError):
    """A ref moved under us: the compare-and-swap lost and nothing was written."""


class RunPausedError(ConflictError):
    """A supervisor paused the run; nothing was appended."""


class IntegrityError(KvtraceError):
    """Bytes do not hash to their address (tampered store or bundle)."""


class StoreError(KvtraceError):
    """The database failed; the message carries the backend's reason."""


class StoreFullError(StoreError):
    """The disk under the store is full: nothing of the write landed."""


class RetryableError(StoreError):
    """The database aborted the transaction (deadlock, serialization failure); retry it.

    Nothing was written. Store methods that write retry this themselves a few
    times; it reaches the caller only when every attempt was aborted.
    """


class CacheError(KvtraceError):
    """The KV cache cannot serve a request."""


class BlockWriteError(CacheError):
    """A KV block could not be written to the disk tier (a full or read-only folder).

    The disk tier is a cache: its callers log this (engine/faults.py) and go
    on computing without the block.
    """


class GenerationCancelledError(KvtraceError):
    """The caller cancelled a generation between two decode steps; its output was not kept."""


class ReplayError(KvtraceError):
    """Replay or continue cannot proceed."""


class MissingToolError(ReplayError):
    """A continued run asked for a tool that the caller did not register."""


class BackendError(ReplayError):
    """A remote OpenAI-compatible backend failed or answered malformed data."""


class EngineRefusedError(BackendError):
    """A remote engine has no endpoint for a question beyond chat completions (its tokens,
    its cache reset), or refused it; the message says which (kvtrace/replay/engines.py)."""


class TracerError(KvtraceError):
    """The tracer (transports, `kvtrace serve`, `kvtrace record`) cannot proceed."""


class UnrecordedRequestError(TracerError):
    """A replaying transport got a request that the recording does not hold."""


class RecordedToolError(TracerError):
    """The error a tool call raised when it was recorded, raised again by `kvtrace.replaying`.

    Only its type's name and message were recorded (`"Type: message"`): a
    built-in exception type is raised as itself, any other as this error,
    whose `type_name` is the recorded type's name.
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
