"""Whether the model can fit in vLLM's share at all: its weights plus the KV cache of one max_model_len sequence.

vLLM finds out only after loading the weights (10 to 45 minutes on a GB10)
and then exits with `no_kv_memory`. Both numbers are known before: the
weights are the safetensors files on disk, and the KV cache of one token
follows from the model's config.json (attention layers, KV heads, head
size, the cache's dtype). This is a lower bound (activations and CUDA
graphs need more), so a warning from it is never a false alarm; it warns
and never refuses, since the estimate may miss a model's peculiarity.

`share_warning` decides; `gb10d.machine.memory.model_on_disk` reads the files.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..base.units import gib

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelOnDisk:
    """The model's weights on disk, in bytes, and its config.json (empty when there is none)."""

    weights: int
    config: Mapping[str, Any]


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal model keeps its language model's figures in `text_config`."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def kv_bytes_per_token(config: Mapping[str, Any], kv_cache_dtype: str | None) -> int | None:
    """The KV cache one token takes across the attention layers; None when config.json does not say enough.

    Linear-attention layers (`layer_types`) keep no per-token cache; an MLA
    model (`kv_lora_rank`) caches its compressed latent once per layer.
    """
    c = _text_config(config)
    layers = c.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(1 for t in types if t in ("full_attention", "attention", "sliding_attention"))
    dtype = str(kv_cache_dtype or "auto")
    width = 1 if dtype.startswith("fp8") else _DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "bfloat16"), 2)
    if isinstance(c.get("kv_lora_rank"), int):
        return int(layers * (c["kv_lora_rank"] + int(c.get("qk_rope_head_dim") or 0)) * width)
    heads = c.get("num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if isinstance(c.get("hidden_size"), int) and isinstance(heads, int) and heads else None)
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        return None
    return 2 * layers * kv_heads * head_dim * width


def max_model_len(arg: Any, config: Mapping[str, Any]) -> int | None:
    """`--max-model-len` as vLLM reads it (`32768`, `32k`, `1m`), else the model's own `max_position_embeddings`."""
    if arg is None:
        value = _text_config(config).get("max_position_embeddings")
        return value if isinstance(value, int) else None
    match = re.fullmatch(r"(\d+)([kKmM]?)", str(arg).strip())
    if match is None:
        return None
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[match.group(2)]
    return int(match.group(1)) * scale


def share_warning(model: ModelOnDisk, utilization: float, total_bytes: int, length_arg: Any, kv_cache_dtype: str | None) -> str | None:
    """The warning, with the numbers, when weights plus one max_model_len sequence's KV cache exceed the share; else None."""
    share = utilization * total_bytes
    length = max_model_len(length_arg, model.config)
    per_token = kv_bytes_per_token(model.config, kv_cache_dtype)
    kv = length * per_token if length is not None and per_token is not None else 0
    if model.weights == 0 or model.weights + kv <= share:
        return None
    need = model.weights + kv
    said_kv = f" plus the KV cache of one {length}-token sequence ({gib(kv)})" if kv else ""
    fixes = [f"raise vllm.gpu_memory_utilization to at least {math.ceil(need / total_bytes * 100) / 100:g}"] if need < total_bytes else []
    if kv and model.weights < share and per_token:
        fixes.append(f"lower max_model_len to at most {int((share - model.weights) // per_token)}")
    return (
        f"the share of {utilization:g} ({gib(share)} of {gib(total_bytes)}) cannot hold the weights "
        f"({gib(model.weights)} on disk){said_kv}: {gib(need)}; vLLM would load for minutes and then exit "
        f"with no_kv_memory" + (f"; {' or '.join(fixes)}" if fixes else "; the model does not fit this machine")
    )
