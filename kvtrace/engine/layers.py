"""What each layer of a model keeps between tokens: its cache kind, read from the config.

A model is a list of layer kinds, never a name. transformers 5.x reads the
kinds from the config (`layer_types`, or `sliding_window`,
`attention_chunk_size`, and each family's own fields such as
`attn_layer_period` or `full_attention_interval`, which its config turns into
`layer_types`) and builds one cache layer per kind (`DynamicCache(config=)`);
this module names what those layers hold:

- `FULL`: keys and values of every token (grows with the context);
- `WINDOW`: keys and values of the last `window` tokens only (sliding or
  chunked attention: Gemma 2/3, gpt-oss, Mistral);
- `STATE`: a fixed-size recurrent or convolution state (Mamba, Mamba2,
  gated DeltaNet, LFM2's short convolutions, RWKV), whatever the context;
- `FULL_STATE`, `WINDOW_STATE`: a layer that keeps both (a parallel hybrid);
- `NONE`: nothing (a layer reading another layer's KV).

Sizes are measured, not guessed from config fields that differ per family:
`measure_layout` runs a few tokens through the loaded model and reads each
cache layer's tensors, so KV heads, head dims and state shapes are the
model's own. Bytes for N tokens: full layers 2 x KV heads x head dim x N x
element size; window layers the same with min(N, window - 1); state layers
constant.

`steps_one_token`: some transformers implementations (Mamba 1's mixer, and
Jamba's, which shares it) restart their scan from zero in any forward of
more than one token, ignoring the state the cache carries, so a prompt
computed in chunks would be wrong after the first. The probe compares one
forward with the same tokens in two forwards; where the second forward
forgets the state, prefill continues such a model one token per forward
(statecache.py), which is right, if slow.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from kvtrace.engine.modelstate import ModelState, is_state_name
from kvtrace.errors import UnsupportedModelError

_PROBE_TOKENS = 8


class LayerKind(StrEnum):
    """What one layer keeps between tokens (module docstring)."""

    FULL = "full attention"
    WINDOW = "sliding window"
    STATE = "recurrent state"
    FULL_STATE = "full attention + recurrent state"
    WINDOW_STATE = "sliding window + recurrent state"
    NONE = "no cache"

    @property
    def has_kv(self) -> bool:
        return self in (LayerKind.FULL, LayerKind.WINDOW, LayerKind.FULL_STATE,
                        LayerKind.WINDOW_STATE)

    @property
    def has_state(self) -> bool:
        return self in (LayerKind.STATE, LayerKind.FULL_STATE, LayerKind.WINDOW_STATE)

    @property
    def is_windowed(self) -> bool:
        return self in (LayerKind.WINDOW, LayerKind.WINDOW_STATE)


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's cache: its kind, window, KV bytes per token and state bytes."""

    kind: LayerKind
    window: int | None = None
    kv_bytes_per_token: int = 0
    state_bytes: int = 0

    def num_bytes(self, num_tokens: int) -> int:
        """What this layer holds after `num_tokens` tokens (a window layer keeps the last
        W - 1 rows, as transformers' `DynamicSlidingWindowLayer` does: the next token's
        query brings its own)."""
        rows = min(num_tokens, self.window - 1) if self.window is not None else num_tokens
        return (rows * self.kv_bytes_per_token if self.kind.has_kv else 0) + self.state_bytes


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """The cache kind of every layer, and how prefill must step the model."""

    layers: tuple[LayerCache, ...]
    steps_one_token: bool = False
    # The model's forward takes the state list of RWKV-style models (`state=`), not a Cache.
    uses_state_list: bool = False

    @property
    def is_plain(self) -> bool:
        """Every layer attends to the whole context: the fast path (cache.py, prefilling.py)."""
        return all(layer.kind is LayerKind.FULL for layer in self.layers)

    @property
    def has_state(self) -> bool:
        return any(layer.kind.has_state for layer in self.layers)

    def num_bytes(self, num_tokens: int) -> dict[LayerKind, int]:
        """Bytes the cache holds after `num_tokens` tokens, per layer kind present."""
        sizes: dict[LayerKind, int] = {}
        for layer in self.layers:
            sizes[layer.kind] = sizes.get(layer.kind, 0) + layer.num_bytes(num_tokens)
        return sizes

    def kinds(self) -> dict[LayerKind, list[int]]:
        """Layer indices per kind, in the order kinds first appear."""
        out: dict[LayerKind, list[int]] = {}
        for i, layer in enumerate(self.layers):
            out.setdefault(layer.kind, []).append(i)
        return out

    def describe(self) -> str:
        """One line: which cache each layer uses (shown when a model loads)."""
        parts = []
        for kind, indices in self.kinds().items():
            windows = sorted({w for i in indices if (w := self.layers[i].window)})
            window = f" of {'/'.join(map(str, windows))} tokens" if windows else ""
            parts.append(f"{len(indices)} x {kind}{window} (layers {_ranges(indices)})")
        line = ", ".join(parts)
        return line + ("; prefill steps one token at a time" if self.steps_one_token else "")


def plain_layout(num_layers: int, kv_bytes_per_token: int) -> ModelLayout:
    """A decoder whose every layer attends to the whole context (no probe needed)."""
    per_layer = kv_bytes_per_token // num_layers
    return ModelLayout(tuple(LayerCache(LayerKind.FULL, kv_bytes_per_token=per_layer)
                             for _ in range(num_layers)))


def check_supported(config: Any, where: str) -> None:
    """Refuse, in one line naming the config field, a model whose cache kvtrace cannot keep."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{where}: an encoder-decoder model (config is_encoder_decoder=true); kvtrace "
            f"reuses the cache of decoder-only causal language models"
        )


def kinds_from_config(config: Any, where: str) -> list[tuple[LayerKind, int | None]] | None:
    """Each layer's kind and window as transformers builds its cache, or None when the
    model keeps no `Cache` at all (an RWKV-style state list; `measure_layout` finds out)."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DummyLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionLayer,
    )

    if _takes_state_list(config):
        return None
    kinds_by_type = {  # most derived first: the hybrids subclass the plain layers
        LinearAttentionAndSlidingWindowAttentionLayer: LayerKind.WINDOW_STATE,
        LinearAttentionAndFullAttentionLayer: LayerKind.FULL_STATE,
        LinearAttentionLayer: LayerKind.STATE,
        DynamicSlidingWindowLayer: LayerKind.WINDOW,
        DummyLayer: LayerKind.NONE,
    }
    try:
        layers = DynamicCache(config=config).layers
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        field = "layer_types" if getattr(config, "layer_types", None) else "model_type"
        raise UnsupportedModelError(
            f"{where}: kvtrace cannot build a cache for this model (config {field}="
            f"{getattr(config, field, None)!r}): {exc}"
        ) from exc
    types = list(getattr(config, "layer_types", None) or [])
    out: list[tuple[LayerKind, int | None]] = []
    for i, layer in enumerate(layers):
        kind = next((k for cls, k in kinds_by_type.items() if isinstance(layer, cls)), None)
        if kind is None and type(layer) is DynamicLayer:
            kind = LayerKind.FULL
        if kind is None:
            named = f"layer_types[{i}]={types[i]!r}" if i < len(types) else "layer_types"
            raise UnsupportedModelError(
                f"{where}: layer {i} keeps a {type(layer).__name__} cache (config {named}), "
                f"which kvtrace cannot reuse"
            )
        window = getattr(layer, "sliding_window", None) if kind.is_windowed else None
        out.append((kind, int(window) if window is not None else None))
    return out


def measure_layout(model: Any, where: str,
                   kinds: list[tuple[LayerKind, int | None]] | None = None) -> ModelLayout:
    """Run a few tokens through `model` to measure each layer's cache; probe chunked steps."""
    config = model.config
    if kinds is None:  # the loader passes what it read from the config already
        kinds = kinds_from_config(config, where)
    uses_state_list = kinds is None
    ids = torch.arange(1, _PROBE_TOKENS + 1, device=model.device).unsqueeze(0) % max(
        2, int(model.get_input_embeddings().weight.shape[0]))
    state = ModelState.empty(model, uses_state_list=uses_state_list)
    try:
        with torch.inference_mode():
            state.forward(model, ids, start=0)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        raise UnsupportedModelError(
            f"{where}: a forward with kvtrace's cache failed ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}); kvtrace cannot keep this model's cache"
        ) from exc
    if uses_state_list:
        tensors = state.state_tensors_per_layer()
        layers = tuple(LayerCache(LayerKind.STATE, state_bytes=_bytes(t)) for t in tensors)
    else:
        assert kinds is not None
        measured = []
        for (kind, window), layer in zip(kinds, state.cache.layers, strict=True):
            kv = 0
            if kind.has_kv and getattr(layer, "keys", None) is not None:
                keys = layer.keys
                kv = 2 * int(keys.shape[1]) * int(keys.shape[3]) * keys.element_size()
            states = ModelState.layer_states(layer) if kind.has_state else []
            measured.append(LayerCache(kind, window, kv, _bytes(states)))
        layers = tuple(measured)
    steps_one = layers and any(layer.kind.has_state for layer in layers) and _forgets_state(
        model, ids, uses_state_list)
    return ModelLayout(layers, steps_one_token=bool(steps_one), uses_state_list=uses_state_list)


def _forgets_state(model: Any, ids: torch.Tensor, uses_state_list: bool) -> bool:
    """Whether a forward of several tokens ignores the state the cache carries (docstring).

    Compares the states themselves, not the logits: in a hybrid model the
    attention layers can hide a wrong recurrent state from the logits of a
    tiny probe. One forward of the probe's tokens against the same tokens in
    two forwards: a state more than 1e-3 (relative) away is a forgotten one.
    """
    half = ids.shape[1] // 2

    def states(splits: list[int]) -> list[torch.Tensor]:
        state = ModelState.empty(model, uses_state_list=uses_state_list)
        pos = 0
        with torch.inference_mode():
            for n in splits:
                state.forward(model, ids[:, pos : pos + n], start=pos)
                pos += n
        snapshot = state.snapshot(pos - splits[-1], pos).tensors
        return [t.float() for name, t in sorted(snapshot.items()) if is_state_name(name)]

    whole = states([ids.shape[1]])
    chunked = states([half, ids.shape[1] - half])
    return any(float((a - b).abs().max()) > 1e-3 * max(float(a.abs().max()), 1e-6)
               for a, b in zip(whole, chunked, strict=True))


def _takes_state_list(config: Any) -> bool:
    """RWKV-style models: `forward(state=...)`, no Cache (read off the model class)."""
    from transformers import AutoModelForCausalLM

    try:
        cls: Any = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return False
    forward = getattr(cls, "forward", None)
    return forward is not None and "state" in inspect.signature(forward).parameters


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(spans)
