"""The simulated checkpoint: what the model looks like, whole and per GPU rank."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .settings import GIB

DEFAULT_WEIGHTS_GIB = 27.32
DEFAULT_MAX_MODEL_LEN = 262144
KV_BYTES_PER_TOKEN = 65536


@dataclass(frozen=True)
class ModelFacts:
    """What the simulated checkpoint looks like."""

    name: str
    architecture: str
    weights_gib: float
    shard_files: tuple[Path, ...]
    shards: int
    max_model_len: int
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN

    def per_rank(self, world_size: int) -> ModelFacts:
        """What one of `world_size` GPUs holds: its share of the weights and of each token's KV cache.

        Tensor and pipeline parallelism both split weights and KV heads or
        layers evenly, which is all the memory arithmetic needs.
        """
        if world_size == 1:
            return self
        return dataclasses.replace(
            self, weights_gib=round(self.weights_gib / world_size, 2), kv_bytes_per_token=self.kv_bytes_per_token // world_size
        )


def describe_model(model: str, max_model_len: int | None, shards_override: int | None) -> ModelFacts:
    """The checkpoint: a real local folder's *.safetensors if there are any, else a 27B FP8 of 6 shards."""
    folder = Path(model)
    files: tuple[Path, ...] = ()
    architecture = "Qwen3ForCausalLM"
    try:
        if folder.is_dir():
            files = tuple(sorted(folder.glob("*.safetensors")))
            config = folder / "config.json"
            if config.is_file():
                names = json.loads(config.read_text(encoding="utf-8")).get("architectures") or [architecture]
                architecture = str(names[0])
    except (OSError, ValueError):
        files = ()
    weights = sum(f.stat().st_size for f in files) / GIB if files else DEFAULT_WEIGHTS_GIB
    shards = shards_override or len(files) or 6
    effective_len = DEFAULT_MAX_MODEL_LEN if max_model_len in (None, -1) else int(max_model_len)
    return ModelFacts(model, architecture, round(weights, 2), files, shards, effective_len)
