"""The engine: a transformers causal LM, its tokenizer and its fingerprint.

`load_engine()` takes a model folder, a .gguf file or nothing (the embedded
default); folders.py says which folder that is, converting a GGUF once, and
this module loads it with a plain `from_pretrained`.

Chat templating and tokenisation (tokenizer.py's `ChatTemplating`, shared
with the weightless `load_tokenizer`) are the engine's, so that every caller
(replay, the server, the tracer) gets identical token ids for identical
messages — exact prefix reuse is only as good as that guarantee.

`Engine.fingerprint` names the exact numeric setup: weights, config, dtype,
device type, tokenizer, torch and transformers versions, the attention
implementation and the prefill scheme. Every KV cache key is seeded with it,
so KV is never reused across anything that could change the numbers. Hashing
the weights reads every byte, so that hash is remembered in
`<cache_dir>/fingerprints.json`, keyed by file path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace.engine.attention import (
    FLASH,
    FLASH_BLOCK,
    KERNEL_ATTR,
    TILE,
    register_canonical_attention,
)
from kvtrace.engine.folders import LOADING, OnConvert, cache_root, model_folder
from kvtrace.engine.kernel_probes import flash_is_faster, flash_rows_hold
from kvtrace.engine.layers import (
    LayerKind,
    ModelLayout,
    check_supported,
    kinds_from_config,
    measure_layout,
    plain_layout,
)
from kvtrace.engine.memo import FINGERPRINTS_FILE, YES_NO, Probes, read_memo, write_memo
from kvtrace.engine.numerics import (
    MKL_SETTING,
    native_bfloat16,
    rows_are_invariant,
    threads_are_invariant,
)
from kvtrace.engine.packed import can_pack, pack_linears, packed_rows_hold
from kvtrace.engine.rowblocks import ROWS, pin_rows, pinned_rows_hold
from kvtrace.engine.threads import engine_threads
from kvtrace.engine.tokenizer import ChatTemplating, context_length, stop_token_ids
from kvtrace.errors import ModelNotFoundError, UnsupportedModelError, UsageError

# Bump when a change to prefill or the attention function changes the bits of
# the KV it computes: old KV on disk then stops matching instead of being
# silently reused. (Chunks padded to 16 rows instead of 64, starting at any
# offset, give the same bits as before, so blocks written by either reuse
# alike: tests/engine/test_live.py.) v2: the softmax normalises before the value
# product (attention.py), so v1 blocks no longer match. v3: value tiles of 128 keys.
PREFILL_SCHEME = f"kvtrace-prefill-v3:padded-block-chunks:tiled-attention-{TILE}:row-softmax"
# Models with window or state layers (stateprefill.py): the model's own attention,
# block-aligned unpadded chunks, a state per block.
STATE_PREFILL_SCHEME = "kvtrace-state-prefill-v1:block-aligned-chunks"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
AUTO_DTYPE = "auto"  # bfloat16 where the CPU computes it natively, else float32


@dataclass(frozen=True, slots=True)
class Engine(ChatTemplating):
    """A loaded model ready for prefill and decode (eval mode, no grad)."""

    name: str
    path: Path
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    attn_implementation: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_tokens: int | None = None
    # Rows per linear product in prefill's forwards, where the GEMM is not row-invariant
    # (rowblocks.py); None: products of any row count.
    pinned_rows: int | None = None
    # How many linear layers hold oneDNN's packed weights (packed.py): F.linear's bits, faster.
    packed_linears: int = 0
    # What each layer keeps (layers.py): all full attention, or the block-state path.
    layout: ModelLayout = field(default_factory=lambda: ModelLayout(()))
    # The numerics probes' answers, remembered in the cache folder by a loaded engine
    # (memo.py); an engine built by hand keeps them in memory.
    probes: Probes = field(default_factory=Probes.in_memory)


def load_engine(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    on_convert: OnConvert | None = None,
) -> Engine:
    """Load a model folder (or a .gguf file, or the embedded default when None).

    `cache_dir` holds converted models and the weight-hash memo; None means
    `kvtrace.paths.default_cache_dir()`. `device` defaults to CUDA when present,
    else CPU; `dtype` defaults to float32 ("auto": bfloat16 on a CPU that computes it
    natively, as the CLI's default). `on_convert(message)` is told
    before a GGUF file is converted (once, ~30 s for the default model).
    Threads may call it at once: their loads take turns (folders.py's `LOADING`).
    """
    root = cache_root(cache_dir)
    with LOADING:
        folder = model_folder(name_or_path, root, on_convert=on_convert)
        resolved = _resolve_device(device)
        return _load_folder(folder, root, resolved, resolve_dtype(dtype, resolved))


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from exc


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: float32. "auto" (the CLI's default): bfloat16 on a CPU that computes it natively
    (AVX-512 BF16 or AMX: about twice float32's speed there), else float32."""
    if dtype is None:
        return torch.float32
    if dtype == AUTO_DTYPE:
        native = device.type == "cpu" and native_bfloat16() is True
        return torch.bfloat16 if native else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise UsageError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16 or auto")
    return resolved


def _load_folder(folder: Path, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Engine:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load bar on stderr is noise in a CLI
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the model in {folder}: {exc}") from exc
    check_supported(config, str(folder))
    kinds = kinds_from_config(getattr(config, "text_config", None) or config, str(folder))
    is_plain = kinds is not None and all(kind is LayerKind.FULL for kind, _ in kinds)
    # Full attention everywhere: canonical attention, any resume offset (prefilling.py). Else
    # the model's own attention, in block-aligned chunks (stateprefill.py).
    attn = register_canonical_attention() if is_plain else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True,
            **({"attn_implementation": attn} if attn is not None else {}),
        )
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load the model in {folder}: {exc}") from exc
    except ValueError as exc:  # no causal-LM class for this config, and the like
        raise UnsupportedModelError(
            f"{folder}: transformers cannot load it as a causal language model: "
            f"{' '.join(str(exc).split())}") from exc
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    budget = engine_threads()
    # Measured every load (~0.1 s): it is also what shows whether MKL's strict mode took
    # effect in this process, so the other probes' answers are kept under it (memo.py).
    invariant = rows_are_invariant(model) if is_plain else True
    model_parts = _model_parts(folder, cache_dir, model, device, dtype)
    probes = Probes.in_cache(cache_dir, {**model_parts, "rows_invariant": invariant}, device,
                             budget.most)
    pinned_rows = None
    if not invariant and dtype != torch.float32 and probes.answer(
            "pinned_rows", lambda: pinned_rows_hold(model), YES_NO):
        pin_rows(model)  # bfloat16 with AMX, for one (kvtrace/engine/rowblocks.py)
        pinned_rows = ROWS
    elif not invariant:
        warnings.warn(
            f"{folder.name}: matrix products here give a row other bits depending on how many "
            f"rows share it, so cache hits may differ from cold runs in the last bits; set "
            f"{MKL_SETTING[0]}={MKL_SETTING[1]} before anything uses torch "
            "(kvtrace/engine/numerics.py)",
            stacklevel=3,
        )
    # Whether a row's bits may depend on the thread count: the probe checks the linear
    # products, and a window or state layer's own kernels (transformers' code) run beside
    # them unchecked (a tiny Mamba can give other prefill bits on one thread than on two,
    # docs/cache.md). Then this process computes on one count whatever the load, and the
    # fingerprint names it, so KV another count computed (another process's) never serves it.
    thread_bits = not is_plain or not probes.answer(
        "threads", lambda: threads_are_invariant(model, budget.most), YES_NO)
    if thread_bits:
        budget.hold("this model's bits may differ on other thread counts")
    if dtype == torch.bfloat16 and device.type == "cpu" and native_bfloat16() is False:
        warnings.warn(
            "this CPU has no native bfloat16 (AVX-512 BF16 or AMX): bfloat16 computes ~10x "
            "slower than float32 here (--dtype float32; kvtrace/engine/numerics.py)",
            stacklevel=3,
        )
    config = model.config
    text_config = getattr(config, "text_config", None) or config
    element_size = torch.empty((), dtype=dtype).element_size()
    if is_plain:
        num_layers = int(text_config.num_hidden_layers)
        num_heads = int(text_config.num_attention_heads)
        num_kv_heads = int(getattr(text_config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(text_config, "head_dim", None)
                       or text_config.hidden_size // num_heads)
        kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * element_size
        layout = plain_layout(num_layers, kv_bytes_per_token)
        if probes.answer("flash_rows", lambda: flash_rows_hold(
                num_heads, num_kv_heads, head_dim, dtype, device), YES_NO) and probes.answer(
                "flash_faster", lambda: flash_is_faster(
                    num_heads, num_kv_heads, head_dim, dtype, device), YES_NO):
            # torch's fused kernel keeps a row's bits here, and the tiles are not clearly the
            # faster (kernel_probes.py): canonical
            # attention takes it (attention.py's `flash_attention`), else the tiles.
            for holder in {id(config): config, id(text_config): text_config}.values():
                setattr(holder, KERNEL_ATTR, FLASH)
            attn = f"{attn}:{FLASH}-{FLASH_BLOCK}"
    else:
        layout = measure_layout(model, str(folder), kinds)
        num_layers = len(layout.layers)
        num_kv_heads = int(getattr(text_config, "num_key_value_heads", 0) or 0)
        head_dim = int(getattr(text_config, "head_dim", 0) or 0)
        kv_bytes_per_token = sum(layer.kv_bytes_per_token for layer in layout.layers)
    # The config as it is now: a nested config (`text_config`) holds the attention kernel's
    # name set above, which the fingerprint names.
    fingerprint = _fingerprint({**model_parts, "config": _config_dict(model)}, model,
                               tokenizer, attn or "model-default", pinned_rows, layout,
                               threads=budget.most if thread_bits else None)
    # Last: every probe above multiplied the dense weights. Packed products give their bits
    # (packed.py), so the fingerprint does not name them; plain models only, whose layers
    # call their linear modules rather than read a weight themselves.
    packed_linears = 0
    if is_plain and can_pack(dtype, device) and probes.answer(
            "packed_rows", lambda: packed_rows_hold(model, budget.most), YES_NO):
        packed_linears = pack_linears(model)
    return Engine(
        name=folder.name,
        path=folder,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        fingerprint=fingerprint,
        attn_implementation=attn or str(getattr(config, "_attn_implementation", "default")),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_bytes_per_token=kv_bytes_per_token,
        vocab_size=_vocab_size(model),
        eos_token_ids=stop_token_ids(model.generation_config, tokenizer),
        max_context_tokens=context_length(config),
        pinned_rows=pinned_rows,
        packed_linears=packed_linears,
        layout=layout,
        probes=probes,
    )


def _vocab_size(model: Any) -> int:
    """Rows of the input embedding: the ids the model accepts (may exceed the tokenizer's)."""
    return int(model.get_input_embeddings().weight.shape[0])


def _fingerprint(
    model_parts: Mapping[str, Any],
    model: Any,
    tokenizer: Any,
    attn: str,
    pinned_rows: int | None,
    layout: ModelLayout,
    *,
    threads: int | None = None,
) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    tokenizer_digest = hashlib.sha256(
        json.dumps([vocab, tokenizer.chat_template, tokenizer.all_special_tokens]).encode()
    ).hexdigest()
    parts: dict[str, Any] = {
        **model_parts,
        "scheme": PREFILL_SCHEME if layout.is_plain else STATE_PREFILL_SCHEME,
        "tokenizer": tokenizer_digest,
        "attn": attn,
    }
    if not layout.is_plain:  # the model's own kernels compute it: name what chose them
        parts["attn"] = str(getattr(model.config, "_attn_implementation", None))
        parts["kernels"] = _kernel_packages()
    if layout.steps_one_token:  # other forwards, so other bits (layers.py)
        parts["steps_one_token"] = True
    if pinned_rows is not None:  # other bits than unpinned products (rowblocks.py)
        parts["linear_rows"] = pinned_rows
    if threads is not None:  # bits that may depend on the thread count (load_engine)
        parts["threads"] = threads
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _model_parts(folder: Path, cache_dir: Path, model: Any, device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    """What names the model's numbers: its weights, config, dtype, device type and the
    torch and transformers that compute it (the fingerprint's core; memo.py's probe key)."""
    import transformers

    return {
        "weights": _weights_digest(folder, cache_dir),
        "config": _config_dict(model),
        "dtype": str(dtype),
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _config_dict(model: Any) -> dict[str, Any]:
    """The model's config as the fingerprint names it (what is not kvtrace's or a version)."""
    return {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }


# Packages whose presence makes transformers run a window or state layer with other kernels
# than its reference PyTorch code (it says "falling back to its reference ... implementation").
_KERNEL_PACKAGES = ("causal-conv1d", "mamba-ssm", "flash-linear-attention", "kernels", "flash-attn")


def _kernel_packages() -> dict[str, str]:
    """The installed versions of `_KERNEL_PACKAGES` (a block computed with other kernels has
    other bits, so it must not be reused across an install)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in _KERNEL_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _weights_digest(folder: Path, cache_dir: Path) -> str:
    """SHA-256 over every weight file, memoised by (path, size, mtime)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no weight files (*.safetensors, *.bin)")
    memo_path = cache_dir / FINGERPRINTS_FILE
    memo = read_memo(memo_path)
    outer = hashlib.sha256()
    changed = False
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        digest = memo.get(key)
        if digest is None:
            inner = hashlib.sha256()
            with path.open("rb") as fh:
                while chunk := fh.read(1 << 22):
                    inner.update(chunk)
            digest = memo[key] = inner.hexdigest()
            changed = True
        outer.update(f"{path.name}:{digest}\n".encode())
    if changed:
        write_memo(memo_path, memo)
    return outer.hexdigest()
