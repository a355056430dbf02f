"""A Hugging Face cache holding a model, laid out as huggingface_hub leaves it after a download."""

from __future__ import annotations

from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub(hub: Path, model: str, shards: int = 2) -> Path:
    """`hub/models--ORG--NAME` with refs/main, blobs and a snapshot linking to them; returns the snapshot."""
    repo = hub / ("models--" + model.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    blobs = repo / "blobs"
    blobs.mkdir()
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    names = ["config.json", *(f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1))]
    for index, name in enumerate(names):
        blob = blobs / f"{index:064x}"
        blob.write_text('{"architectures": ["Qwen3ForCausalLM"]}' if name == "config.json" else "weights")
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot
