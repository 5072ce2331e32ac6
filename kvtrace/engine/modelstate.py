"""One sequence's cache for a model of any layer kind: step it, snapshot it, restore it.

Wraps what the model's forward carries between calls: a transformers
`DynamicCache` whose layers are full-attention, sliding-window, linear
attention (recurrent and convolution states) or hybrid (layers.py), or the
state list of an RWKV-style model. The block-state tier (statecache.py)
needs three things of it, the same for every kind:

- `forward`: run the next tokens at absolute position `start`;
- `snapshot(start, end)`: what a block boundary keeps so that a later
  prompt can resume there (`BlockState`): the block's own K/V rows for
  attention layers (full layers need every block's rows, window layers only
  the last `window` rows, which the last blocks hold), and a copy of every
  recurrent and convolution state as it stands at `end`;
- `restore(blocks)`: the cache as it stood at the last block's end, built
  from the blocks' states alone.

Restoring gives the layers the same tensors a cold run leaves there, so the
next forward computes on the same bits (the tier's chunks do the rest).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace.errors import CacheError

BlockTensors = dict[str, torch.Tensor]


def is_state_name(name: str) -> bool:
    """Whether a `BlockState` tensor is a recurrent, convolution or state-list state (not
    a layer's K/V rows)."""
    return name[0] in "crs"


def kv_layer(name: str) -> int | None:
    """The layer of a `BlockState` K/V tensor (`k3`, `v3`: 3); None for a state."""
    return None if is_state_name(name) else int(name[1:])


@dataclass(frozen=True, slots=True)
class BlockState:
    """A block's tensors for resuming after it: `k{i}`/`v{i}` rows, `c{i}.{j}`/`r{i}.{j}`
    states (layer i, state j), `s{j}` for a state list."""

    tensors: BlockTensors

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class ModelState:
    """The cache of one sequence being computed (module docstring)."""

    __slots__ = ("cache", "num_tokens", "state_list")

    def __init__(self, cache: Any, state_list: list[torch.Tensor] | None) -> None:
        self.cache = cache
        self.state_list = state_list
        self.num_tokens = 0

    @classmethod
    def empty(cls, model: Any, *, uses_state_list: bool) -> ModelState:
        if uses_state_list:
            return cls(None, None)
        from transformers import DynamicCache

        return cls(DynamicCache(config=model.config), None)

    # -- stepping --------------------------------------------------------------

    def forward(self, model: Any, ids: torch.Tensor, *, start: int, keep: int = 1) -> torch.Tensor:
        """Run `ids` (`[1, n]`) at positions `start …`; the logits of the last `keep` rows."""
        if start != self.num_tokens:
            raise CacheError(f"this state holds {self.num_tokens} tokens, not {start}")
        n = int(ids.shape[1])
        params = _forward_params(model)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
        if "position_ids" in params:
            kwargs["position_ids"] = torch.arange(start, start + n, device=ids.device).unsqueeze(0)
        if "logits_to_keep" in params:
            kwargs["logits_to_keep"] = max(1, keep)
        if self.state_list is not None or self.cache is None:
            kwargs["state"] = self.state_list
        else:
            kwargs["cache"] = self.cache
        out = model(**kwargs)
        if self.cache is None:
            self.state_list = list(out.state)
        self.num_tokens += n
        return out.logits[0, -max(1, keep):] if keep else out.logits[0, :0]

    # -- snapshots ---------------------------------------------------------------

    def snapshot(self, start: int, end: int) -> BlockState:
        """What resuming at `end` needs of block [start, end) (module docstring)."""
        if end != self.num_tokens:
            raise CacheError(f"a snapshot at {end} of a state holding {self.num_tokens} tokens")
        tensors: BlockTensors = {}
        if self.cache is None:
            for j, t in enumerate(self.state_list or []):
                tensors[f"s{j}"] = t.detach().clone()
            return BlockState(tensors)
        n = end - start
        for i, layer in enumerate(self.cache.layers):
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.numel():
                rows = min(n, int(keys.shape[2]))  # a window layer may keep fewer
                tensors[f"k{i}"] = keys[:, :, -rows:].clone()
                tensors[f"v{i}"] = layer.values[:, :, -rows:].clone()
            for j, conv in _states(layer, "conv_states"):
                tensors[f"c{i}.{j}"] = conv.clone()
            for j, rec in _states(layer, "recurrent_states"):
                tensors[f"r{i}.{j}"] = rec.clone()
        return BlockState(tensors)

    @classmethod
    def restore(cls, model: Any, blocks: Sequence[BlockState], num_tokens: int, *,
                uses_state_list: bool) -> ModelState:
        """The state at the end of `blocks` (the first `num_tokens` tokens, in order)."""
        state = cls.empty(model, uses_state_list=uses_state_list)
        if not blocks:
            return state
        last = blocks[-1].tensors
        if uses_state_list:
            state.state_list = [last[f"s{j}"].clone() for j in range(len(last))]
            state.num_tokens = num_tokens
            return state
        for i, layer in enumerate(state.cache.layers):
            if f"k{i}" in last:
                _restore_kv(layer, blocks, i, num_tokens)
            for name, tensor in last.items():
                if name.startswith((f"c{i}.", f"r{i}.")):
                    _restore_state(layer, name[0], int(name.split(".")[1]), tensor)
        state.num_tokens = num_tokens
        return state

    # -- sizes (layers.py measures with these) -------------------------------------

    def state_tensors_per_layer(self) -> list[list[torch.Tensor]]:
        """A state list's tensors (`[1, hidden, layers]` each), split per layer."""
        tensors = self.state_list or []
        num_layers = int(tensors[0].shape[-1]) if tensors else 0
        return [[t[..., i] for t in tensors] for i in range(num_layers)]

    @staticmethod
    def layer_states(layer: Any) -> list[torch.Tensor]:
        return [t for _, t in _states(layer, "conv_states")] + [
            t for _, t in _states(layer, "recurrent_states")]


def _restore_kv(layer: Any, blocks: Sequence[BlockState], i: int, num_tokens: int) -> None:
    keys = torch.cat([b.tensors[f"k{i}"] for b in blocks if f"k{i}" in b.tensors], dim=2)
    values = torch.cat([b.tensors[f"v{i}"] for b in blocks if f"v{i}" in b.tensors], dim=2)
    window = getattr(layer, "sliding_window", None)
    if window is not None:  # what DynamicSlidingWindowLayer keeps: the last window - 1 rows
        keep = min(num_tokens, int(window) - 1)
        keys, values = keys[:, :, -keep:], values[:, :, -keep:]
        if int(keys.shape[2]) != keep:
            raise CacheError(f"window layer {i}: blocks hold {keys.shape[2]} rows, not {keep}")
    elif int(keys.shape[2]) != num_tokens:
        raise CacheError(f"layer {i}: blocks hold {keys.shape[2]} KV rows for {num_tokens} tokens")
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
    if window is not None:
        layer.cumulative_length = num_tokens


def _restore_state(layer: Any, kind: str, j: int, tensor: torch.Tensor) -> None:
    if layer.device is None:
        layer.dtype, layer.device = tensor.dtype, tensor.device
    if kind == "c":
        layer.conv_states[j] = tensor.clone()
        layer.conv_kernel_size[j] = int(tensor.shape[-1])
        layer.is_conv_states_initialized[j] = True
        layer.has_previous_state[j] = True
    else:
        layer.recurrent_states[j] = tensor.clone()
        layer.is_recurrent_states_initialized[j] = True
        layer.has_previous_state[j] = True


def _states(layer: Any, attr: str) -> list[tuple[int, torch.Tensor]]:
    states = getattr(layer, attr, None)
    if not isinstance(states, dict):
        return []
    return [(j, t) for j, t in sorted(states.items()) if t is not None]


def _forward_params(model: Any) -> frozenset[str]:
    cached = getattr(model, "_kvtrace_forward_params", None)
    if cached is None:
        cached = frozenset(inspect.signature(model.forward).parameters)
        model._kvtrace_forward_params = cached
    return cached
