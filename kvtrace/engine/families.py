"""Tiny configs of the model families kvtrace serves, one per way of keeping a cache.

For tests and `kvtrace bench cache --family NAME`: each is a real
transformers config of that family (transformers 5.24), shrunk to a few
layers of 64 dims, so a random model of it loads in a second and runs on any
CPU. What matters is the mix of layer kinds (layers.py), which is the
family's own: sliding windows (Gemma 3, gpt-oss, Mistral), Mamba or Mamba2
beside attention (Jamba, Bamba, Falcon-H1, Granite 4), gated DeltaNet
(Qwen3-Next), short convolutions (LFM2), pure recurrent models (Mamba2,
Mamba, RWKV) and mixtures of experts over full attention (Qwen3-MoE, OLMoE).

`write_family` writes one as a model folder with a given tokenizer
(folders.py's `build_model_from_config`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtrace.errors import UsageError

# Small windows and chunks, so that a few hundred test tokens cross them many times.
WINDOW = 48
_ATTN = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2}
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
           "mamba_chunk_size": 16}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 4,
                                    "sliding_window": WINDOW, "sliding_window_pattern": 2,
                                    "layer_types": None}),
    "gpt_oss": ("GptOssConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 4,
                                 "sliding_window": WINDOW, "num_local_experts": 4,
                                 "num_experts_per_tok": 2}),
    "mistral": ("MistralConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 2,
                                  "sliding_window": WINDOW}),
    "jamba": ("JambaConfig", {**_ATTN, "num_hidden_layers": 4, "attn_layer_period": 2,
                              "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "num_experts": 4, "mamba_d_state": 8,
                              "mamba_dt_rank": 8, "mamba_expand": 2}),
    "bamba": ("BambaConfig", {**_ATTN, **_MAMBA2, "num_hidden_layers": 4,
                              "attn_layer_indices": [1]}),
    "falcon_h1": ("FalconH1Config", {**_ATTN, **_MAMBA2, "head_dim": 16, "num_hidden_layers": 2,
                                     "mamba_d_ssm": 128}),
    "granite_moe_hybrid": ("GraniteMoeHybridConfig", {
        **_ATTN, **_MAMBA2, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_next": ("Qwen3NextConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 4,
                                       "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                       "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 64,
                                       "shared_expert_intermediate_size": 64}),
    "lfm2": ("Lfm2Config", {**_ATTN, "num_hidden_layers": 4,
                            "layer_types": ["conv", "full_attention", "conv", "full_attention"]}),
    "mamba2": ("Mamba2Config", {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8,
                                "head_dim": 16, "n_groups": 1, "state_size": 8,
                                "chunk_size": 16, "expand": 2}),
    "mamba": ("MambaConfig", {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8,
                              "expand": 2}),
    "rwkv": ("RwkvConfig", {"hidden_size": 64, "num_hidden_layers": 2,
                            "attention_hidden_size": 64, "intermediate_size": 128,
                            "context_length": 4096}),
    "qwen3_moe": ("Qwen3MoeConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 2,
                                     "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64}),
    "olmoe": ("OlmoeConfig", {**_ATTN, "head_dim": 16, "num_hidden_layers": 2,
                              "num_experts": 4, "num_experts_per_tok": 2}),
}


def family_config(name: str, *, vocab_size: int, bos_token_id: int | None = None,
                  eos_token_id: int | None = None, pad_token_id: int | None = None) -> Any:
    """The tiny config of family `name` (one of `FAMILIES`) for a tokenizer's ids."""
    import transformers

    if name not in FAMILIES:
        raise UsageError(f"unknown model family {name!r}: one of {', '.join(FAMILIES)}")
    cls_name, fields = FAMILIES[name]
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
           "pad_token_id": pad_token_id}
    return getattr(transformers, cls_name)(vocab_size=vocab_size, **fields, **ids)


def write_family(name: str, path: str | os.PathLike[str], *,
                 tokenizer_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random model folder of family `name`, with the tokenizer in `tokenizer_dir`."""
    from transformers import AutoTokenizer

    from kvtrace.engine.folders import build_model_from_config

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = family_config(name, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    return build_model_from_config(path, config, tokenizer_dir=tokenizer_dir, seed=seed)
