"""Where a Hugging Face model lives on disk, resolved the way huggingface_hub resolves it.

vLLM finds a model given by repository id (`Qwen/Qwen3.6-27B-FP8`) through
huggingface_hub's cache: `<hub>/models--Qwen--Qwen3.6-27B-FP8/refs/main`
names a commit, `snapshots/<commit>/` holds the files (links into
`blobs/`). The hub directory comes from the environment, first of
`HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`,
`$XDG_CACHE_HOME/huggingface/hub`, `~/.cache/huggingface/hub`, with `~`
and `$VAR` expanded (huggingface_hub's constants.py). gb10d needs the same
answer to evict the model's pages, to tell the operator whether the
service will find the model already downloaded, and to check that the
service user may read it; gb10d.sim needs it to tell a cache hit from a
download as vLLM does.

`hub_cache` and `repo_folder` are pure; `cached_snapshot` reads two small
files and never writes.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Mapping

_TRUE = {"1", "ON", "YES", "TRUE"}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _expand(path: str, env: Mapping[str, str], home: str) -> str:
    """os.path.expanduser then expandvars, against `env` and `home` instead of this process's."""
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), path)


def hub_cache(env: Mapping[str, str], home: str) -> str:
    """The hub cache directory huggingface_hub uses in a process with this environment and home directory."""
    hf_home = _expand(env.get("HF_HOME") or posixpath.join(env.get("XDG_CACHE_HOME") or posixpath.join(home, ".cache"), "huggingface"), env, home)
    legacy = env.get("HUGGINGFACE_HUB_CACHE") or posixpath.join(hf_home, "hub")
    return _expand(env.get("HF_HUB_CACHE") or legacy, env, home)


def hub_cache_source(env: Mapping[str, str]) -> str:
    """Which variable decides the hub cache (for messages), or "" when it is the home directory's default."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        if env.get(name):
            return name
    return ""


def offline(env: Mapping[str, str]) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE): huggingface_hub uses only what the cache holds."""
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def is_repo_id(model: str) -> bool:
    """Whether vLLM would look `model` up on the hub rather than as a local directory (which must exist)."""
    return not model.startswith(("/", "./", "../", "~")) and _REPO_ID.fullmatch(model) is not None


def repo_folder(model: str) -> str:
    """The folder of a model repository inside the hub cache: `Qwen/Qwen3.6-27B-FP8` -> `models--Qwen--Qwen3.6-27B-FP8`."""
    return "--".join(["models", *model.split("/")])


def cached_snapshot(hub: str | Path, model: str, revision: str = "main") -> Path | None:
    """The snapshot directory of `model` in the hub cache when it holds the model's config.json, else None.

    This is the test vLLM makes before it goes to the network
    (`try_to_load_from_cache(model, "config.json")`): the ref names a
    commit, and that commit's snapshot has the file. A cache the caller
    may not read counts as empty, as it does for huggingface_hub.
    """
    repo = Path(hub) / repo_folder(model)
    try:
        commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip() if revision == "main" or not _is_commit(revision) else revision
        snapshot = repo / "snapshots" / commit
        return snapshot if (snapshot / "config.json").is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


def _is_commit(revision: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def weight_files(snapshot: Path) -> list[Path]:
    """The *.safetensors files of a snapshot or local model directory, in name order; none if unreadable."""
    try:
        return sorted(snapshot.glob("*.safetensors"))
    except OSError:
        return []

