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
GENERATE = ("generate",)
# vLLM's `Supported tasks` of a pooling model: an embedding model's pooler serves both (in a set's order).
EMBED = ("embed", "token_embed")
CLASSIFY = ("classify", "token_classify")


@dataclass(frozen=True)
class Checkpoint:
    """A repository the stand-in knows by name, sized as the real one."""

    architecture: str
    weights_gib: float
    shards: int
    max_model_len: int
    kv_bytes_per_token: int
    tasks: tuple[str, ...]


# Qwen3-Embedding-8B: 7.57 B parameters in BF16 (15.1 GB in 4 shards), 36 layers of 8 KV heads of 128, 40960 positions.
KNOWN: dict[str, Checkpoint] = {
    "Qwen/Qwen3-Embedding-8B": Checkpoint("Qwen3ForCausalLM", 14.1, 4, 40960, 2 * 36 * 8 * 128 * 2, EMBED),
}
# `--convert` (or `--runner pooling`, which converts to embed) makes a pooling model of a generative one.
_CONVERTED = {"embed": EMBED, "classify": CLASSIFY}


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
    tasks: tuple[str, ...] = GENERATE  # what `Supported tasks` says, hence the routes the API server opens

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


def describe_model(
    model: str, max_model_len: int | None, shards_override: int | None, runner: str = "auto", convert: str = "auto"
) -> ModelFacts:
    """The checkpoint: a real local folder's *.safetensors if there are any, a repository of `KNOWN` as the real
    one, else a 27B FP8 of 6 shards that generates; `--runner pooling` or `--convert` make it a pooling model."""
    known = KNOWN.get(model)
    tasks = _CONVERTED.get(convert) or (EMBED if runner == "pooling" else known.tasks if known else GENERATE)
    if known is not None:
        effective = known.max_model_len if max_model_len in (None, -1) else int(max_model_len)
        shards = shards_override or known.shards
        return ModelFacts(model, known.architecture, known.weights_gib, (), shards, effective, known.kv_bytes_per_token, tasks)
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
    return ModelFacts(model, architecture, round(weights, 2), files, shards, effective_len, tasks=tasks)
