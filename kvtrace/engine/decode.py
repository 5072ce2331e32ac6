"""Decode steps: the next token of one sequence or many, in one padded forward.

Why padded: CPU GEMMs give a row the same bits whatever the row count from
12 rows up, and not below on every machine (prefilling.py, docs/cache.md). A
decode forward therefore always runs a multiple of the engine's decode row
multiple: each sequence's last token, one row each, then padding rows whose
outputs are dropped. That multiple is 16 unless a probe of the engine's own
model on this machine (`row_multiple`) shows that a row gets the same bits
from forwards of 4 (or 8) rows as from 16: on the machines measured it does
(4 rows cost a lone generation what 1 row costs; 16 rows cost it ~25 %
more per token, docs/benchmarks.md). Everything but attention is row-wise
(the embedding, the norms, the linear layers, the MLP, the output layer),
and a row's bits there do not depend on the other rows' values, so a
sequence's logits have the same bits whether it decodes alone or with up to
15 others, in any row (tests/engine/test_batch.py).

Attention is per sequence: the step hands the model a `RowRouter` as its
cache, which appends each row's key and value to that sequence's own
`GrowingLayer`s (kvbuffer.py) and keeps the sequence's whole K/V for the
attention function; `decode_attention.py` then runs each sequence's one
query row over its own K/V, reading the first part of a prompt once for all
the sequences whose prompts start alike (a fork point's), and gives padding
rows zeros. Sequences of different lengths thus share every other layer
with no mask and no padding of their KV.

Models with window or state layers (layers.py) decode each sequence in a
one-row forward of its own (`_step_alone`), on its `ModelState`.

Decoded KV is not canonical (one query row through `sdpa`, not the tiled
attention): it is never stored (generation.py re-prefills the output).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvtrace.engine.attention import ROUTER_KWARG
from kvtrace.engine.decode_attention import SequenceKV, SharedPrefix, sharing_groups
from kvtrace.engine.kvbuffer import GrowingLayer, growing_layers
from kvtrace.engine.model import Engine
from kvtrace.engine.modelstate import ModelState
from kvtrace.engine.prefilling import ROW_MULTIPLE, prefill
from kvtrace.engine.threads import engine_threads
from kvtrace.errors import CacheError

_PAD_TOKEN = 0
_CANDIDATE_MULTIPLES = (4, 8)  # tried in turn; ROW_MULTIPLE when neither holds
_PROBE_TOKENS = 24


class Decoding:
    """One sequence being decoded: its KV, the logits of its next token, its tokens so far."""

    __slots__ = ("generator", "kv", "layers", "logits", "prefix", "temperature", "tokens",
                 "top_p")

    def __init__(
        self,
        kv: object,
        logits: torch.Tensor,
        *,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        """`prompt_ids`: the tokens `kv` holds, when known: their first part may then be
        read once with other sequences that start alike (decode_attention.py). `kv`
        None: a generation of one token, chosen from `logits`, that never steps."""
        if kv is not None and not isinstance(kv, DynamicCache | ModelState):
            raise CacheError("decoding needs a prefill's DynamicCache or ModelState")
        self.kv = kv
        self.layers = growing_layers(kv) if isinstance(kv, DynamicCache) else []
        if kv is not None and prompt_ids and len(prompt_ids) != self.num_kv_rows:
            raise CacheError(f"{len(prompt_ids)} prompt ids for {self.num_kv_rows} KV rows")
        self.prefix = SharedPrefix.of(prompt_ids)
        self.logits = logits
        self.temperature = temperature
        self.top_p = top_p
        self.generator = generator
        self.tokens: list[int] = []

    def choose(self) -> int:
        """Draw the next token from the logits: greedy, or from this sequence's generator."""
        token = choose_token(self.logits, self.temperature, self.top_p, self.generator)
        self.tokens.append(token)
        return token

    @property
    def num_kv_rows(self) -> int:
        if isinstance(self.kv, ModelState):
            return self.kv.num_tokens
        return self.layers[0].get_seq_length()

    def detach(self) -> None:
        """Move this sequence's KV into buffers of its own, so a prefill may take the old ones.

        A `ModelState` already holds tensors of its own (modelstate.py): nothing to move.
        """
        for layer in self.layers:
            layer.detach()


class RowRouter(DynamicCache):
    """The cache a batched decode forward sees: row i's K/V go to sequence i's layers.

    `update` appends each real row to its sequence's `GrowingLayer` and keeps
    the sequence's whole K/V (`rows[layer]`) for the attention function;
    padding rows are written nowhere. What it returns is the step's own
    rows, which nothing reads (attention takes `rows`). `groups` are the
    sequences that read their prompts' shared part together, the same in
    every layer.
    """

    def __init__(self, config: object, sequences: Sequence[Decoding]) -> None:
        super().__init__(config=config)  # type: ignore[arg-type]
        self.sequences = list(sequences)
        self.rows: dict[int, list[SequenceKV]] = {}
        self.groups = sharing_groups([sequence.prefix for sequence in self.sequences])

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        per_sequence = []
        for i, sequence in enumerate(self.sequences):
            layer: GrowingLayer = sequence.layers[layer_idx]
            key, value = layer.update(key_states[:, :, i : i + 1], value_states[:, :, i : i + 1])
            split = 0 if sequence.prefix is None else sequence.prefix.length
            per_sequence.append(SequenceKV(key, value, split))
        self.rows[layer_idx] = per_sequence
        return key_states, value_states


def decode_rows(num_sequences: int, multiple: int = ROW_MULTIPLE) -> int:
    """Rows of the forward that decodes `num_sequences` sequences: a multiple of `multiple`."""
    return max(multiple, -(-num_sequences // multiple) * multiple)


def row_multiple(engine: Engine) -> int:
    """The smallest padding multiple whose forwards give a row the bits of a 16-row one.

    Probed once per model and machine (module docstring; the answer is kept
    with the engine's other probes, memo.py): one short sequence decoded one
    step at every width of the candidate multiple up to 16, its whole logits
    compared bit for bit with the 16-row step's. Any difference in any layer
    shows in the logits, and the widths a batch of up to 16 may take are
    exactly the ones compared.
    """
    return engine.probes.answer("decode_row_multiple", lambda: _probe_multiple(engine),
                                (*_CANDIDATE_MULTIPLES, ROW_MULTIPLE))


def _probe_multiple(engine: Engine) -> int:
    tokens = [1 + (7 * i) % (engine.vocab_size - 1) for i in range(_PROBE_TOKENS)]
    pre = prefill(engine, None, tokens)

    def logits_at(width: int) -> torch.Tensor:
        sequence = Decoding(copy.deepcopy(pre.kv), pre.logits, temperature=0.0, top_p=1.0,
                            generator=None)
        sequence.choose()
        decode_forward(engine, [sequence], width)
        return sequence.logits

    reference = logits_at(ROW_MULTIPLE)
    for multiple in _CANDIDATE_MULTIPLES:
        if all(torch.equal(logits_at(width), reference)
               for width in range(multiple, ROW_MULTIPLE, multiple)):
            return multiple
    return ROW_MULTIPLE


def decode_step(engine: Engine, sequences: Sequence[Decoding], *, padded: bool = True) -> None:
    """Feed each sequence's last chosen token; set its logits for the next one.

    One forward of `decode_rows(len(sequences), row_multiple(engine))` rows
    (module docstring), or, with `padded=False`, of one row per sequence:
    what a lone generation outside a batcher runs (generation.py), with bits
    of its own on machines where a 1-row GEMM differs. Each sequence must
    have chosen a token since its last step.
    """
    if not sequences:
        return
    engine_threads().adjust()  # on the cores other processes leave free (threads.py)
    if not engine.layout.is_plain:
        for sequence in sequences:
            _step_alone(engine, sequence)
        return
    width = decode_rows(len(sequences), row_multiple(engine)) if padded else len(sequences)
    decode_forward(engine, sequences, width)


def decode_forward(engine: Engine, sequences: Sequence[Decoding], width: int) -> None:
    """One decode forward of exactly `width` rows (at least one per sequence): `decode_step`
    without the choice of width; the probe and the tests compare widths with it."""
    device = engine.device
    ids = torch.full((1, width), _PAD_TOKEN, dtype=torch.long, device=device)
    positions = torch.zeros((1, width), dtype=torch.long, device=device)
    for i, sequence in enumerate(sequences):
        if not sequence.tokens:
            raise CacheError("a sequence must choose a token before its decode step")
        ids[0, i] = sequence.tokens[-1]
        positions[0, i] = sequence.num_kv_rows
    router = RowRouter(engine.model.config, sequences)
    with torch.inference_mode():
        result = engine.model(
            input_ids=ids,
            position_ids=positions,
            cache=router,
            use_cache=True,
            logits_to_keep=0,  # every row: the output layer sees `width` rows too
            **{ROUTER_KWARG: router},
        )
    logits = result.logits[0].float()
    for i, sequence in enumerate(sequences):
        sequence.logits = logits[i]


def _step_alone(engine: Engine, sequence: Decoding) -> None:
    """A one-row forward on a sequence's own `ModelState` (window or state layers).

    Each sequence steps alone, so batching cannot change its bits: the rows
    of a batched forward would go through its recurrent layers together.
    """
    state = sequence.kv
    if not isinstance(state, ModelState) or not sequence.tokens:
        raise CacheError("a sequence must choose a token before its decode step")
    ids = torch.tensor([[sequence.tokens[-1]]], dtype=torch.long, device=engine.device)
    try:
        with torch.inference_mode():
            logits = state.forward(engine.model, ids, start=state.num_tokens)
    except RuntimeError as exc:  # torch errors: out of memory, bad ids …
        raise CacheError(f"the model failed during decoding: {exc}") from exc
    sequence.logits = logits[-1].float()


def choose_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """Greedy (temperature 0) or temperature + nucleus sampling from `generator`."""
    if temperature == 0 or generator is None:
        return int(torch.argmax(logits).item())
    # In float64 (1e-300 is 0 in float32) and shifted so the top logit is 0: a temperature
    # near 0 then sends the others to -inf, not inf - inf = NaN (greedy, as in the limit).
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / temperature, dim=-1).to(logits.dtype)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[..., 0] = True  # the top token always (a top_p of 1e-300 is 0 in float32)
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
