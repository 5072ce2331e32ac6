"""The backend interface replay talks to, and the records that cross it.

A backend answers one model call at a time, given the chat messages (and,
when the driver has a tokenizer, their token ids). It can either generate a
response (verify, continue) or rebuild: feed the recorded output instead of
generating, so that its cache ends up holding the call's prompt and output.
Two implementations: `LocalBackend` (local.py: the engine and its two-tier
KV cache) and `RemoteBackend` (remote.py: any OpenAI-compatible server).

A backend reports what it reused from its cache for the prompt only (the
prompt's last token always counts as computed): `reused_tokens`, split into
`memory_tokens` and `disk_tokens` where the backend knows the tier (a remote
server reports only the sum), or None when it cannot know at all (a server
that does not report cached tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtrace.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the engine imports torch: its types only, here
    from kvtrace.engine.faults import DiskFaults
    from kvtrace.engine.generation import DraftVerdict
    from kvtrace.replay.engines import EngineFacts

Message = dict[str, Any]


class Tokenizer(Protocol):
    """What replay needs from a tokenizer: chat templating, decoding, stop tokens.

    The engine satisfies it, so every caller tokenises messages identically.
    """

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One model call to send: messages, their token ids if known, and what to feed."""

    messages: list[Message]
    prompt_ids: list[int] | None
    params: SamplingParams
    output_ids: list[int] | None = None  # rebuild: the recorded output's tokens
    output_text: str | None = None  # rebuild: the recorded output's text
    model: str | None = None  # the model the recording names (a remote default)
    draft_ids: list[int] | None = None  # verify: the recorded output, to check in one pass
    tools: list[Message] | None = None  # the request's tool definitions (OpenAI shape)


@dataclass(frozen=True, slots=True)
class CallResult:
    """What a backend did for one call, with its cache accounting for the prompt."""

    prompt_tokens: int
    reused_tokens: int | None  # None: the backend cannot tell
    memory_tokens: int | None  # None: reused, but the tier is not reported (remote)
    disk_tokens: int | None
    text: str
    output_ids: list[int] | None  # None when the backend does not expose token ids
    finish_reason: str
    prefill_s: float
    decode_s: float
    seed: int | None = None  # the sampling seed actually used (recorded, so verify can reuse it)
    draft: DraftVerdict | None = None  # the verdict, when the backend checked the draft
    retries: tuple[str, ...] = ()  # one reason per failed attempt it retried ("HTTP 503")
    # Rebuild: whether the cache now holds the recorded output too. A remote engine is sent
    # the prompt only (it cannot be fed an output), so what it caches of the output comes
    # with the next prompt, and the oracle must not count it before then.
    is_output_fed: bool = True
    # A remote engine answered without usage: prompt_tokens is the tokenizer's count (0
    # without one) and reused_tokens is None.
    is_usage_missing: bool = False

    @property
    def computed_tokens(self) -> int | None:
        reused = self.reused_tokens
        return None if reused is None else self.prompt_tokens - reused


class Backend(Protocol):
    """Something that answers model calls and may reuse a prefix cache."""

    @property
    def name(self) -> str:
        """"local" or the server's URL, for reports."""
        ...

    @property
    def model(self) -> str:
        """The model that answers, for reports and for recording continued steps."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the model that answers, when known (always for local)."""
        ...

    @property
    def is_concurrent(self) -> bool:
        """Whether calls may come from several threads at once (`replay_runs` concurrency)."""
        ...

    @property
    def resume_every(self) -> int:
        """Where a cache hit can end: every token (1), or block boundaries of this many
        tokens (a model with window or state layers, kvtrace/engine/layers.py)."""
        ...

    @property
    def engine_facts(self) -> EngineFacts | None:
        """What a remote engine said of its tokens and block size (engines.py); None for
        the local engine, whose tokenizer and blocks are kvtrace's own."""
        ...

    def engine_counters(self) -> dict[str, int] | None:
        """A remote engine's prefix-cache counters now (engines.read_counters), which a
        replay reports the growth of; None where there are none (local)."""
        ...

    def reset_cache(self) -> str:
        """Empty a remote engine's prefix cache so a replay starts cold; the endpoint that did.
        BackendError where the engine refused; UsageError for the local engine (replay it
        uncached with `without_cache`)."""
        ...

    def generate(self, request: CallRequest) -> CallResult:
        """Generate a response to the prompt with `request.params`.

        `request.draft_ids`, when set, is the response the caller expects.
        The local backend checks it in one prefill before decoding; a remote
        one ignores it. Either way the response is what generating gives,
        and `CallResult.draft` says whether a check ran and its verdict.
        """
        ...

    def rebuild(self, request: CallRequest) -> CallResult:
        """Process the prompt and the recorded output without generating."""
        ...

    def without_cache(self) -> Backend:
        """The same backend with caching off (for `replay(compare_uncached=True)`)."""
        ...

    def settle(self) -> None:
        """Store what the backend's cache is still owed (deferred output) before a session ends."""
        ...

    def take_cache_faults(self) -> DiskFaults | None:
        """What the backend's cache recovered from since last asked, for the report to show.

        A block that could not be written, or was found damaged and
        recomputed (kvtrace/engine/faults.py); None when the backend has no
        disk tier of its own to ask (a remote server keeps its own).
        """
        ...
