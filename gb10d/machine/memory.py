"""The machine's memory read, and the model's files found, measured and their page cache dropped: the I/O of
`gb10d.core.memory` and `gb10d.core.modelfit`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..base.command import model_on_host
from ..base.config import Config
from ..base.hfcache import cached_snapshot, hub_cache, weight_files
from ..core.memory import MemInfo, parse_meminfo
from ..core.modelfit import ModelOnDisk, share_warning


def read_meminfo(path: Path) -> MemInfo:
    """Read and parse a meminfo file (the real /proc/meminfo, or a test's file)."""
    return parse_meminfo(path.read_text(encoding="ascii", errors="replace"))


def safetensors_files(model: str, env: Mapping[str, str]) -> list[Path]:
    """The model's *.safetensors files: a local directory, or the snapshot of its Hugging Face cache that
    refs/main names (the one vLLM loads; other revisions in the cache are not its weights).

    Empty where this process may not look (a home of mode 0750 seen by the
    service user): the path checks say what is in the way, with the fix.
    """
    try:
        local = Path(model).expanduser()
        if local.is_dir():
            return weight_files(local)
    except OSError:
        return []
    snapshot = cached_snapshot(hub_cache(env, env.get("HOME") or os.path.expanduser("~")), model)
    return weight_files(snapshot) if snapshot is not None else []


def evict_page_cache(files: Iterable[Path]) -> int:
    """Drop the page cache of `files` with posix_fadvise(DONTNEED); returns the bytes covered.

    Unprivileged and targeted, unlike drop_caches: only the model's own pages
    go, and only while nothing maps them (gb10d calls this before launching).
    """
    covered = 0
    for path in files:
        try:
            fd = os.open(path.resolve(), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            covered += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return covered


def share_warning_for(config: Config, env: Mapping[str, str], utilization: float, total_bytes: int) -> str | None:
    """share_warning for the model `config` names, found on this host through `env` (vLLM's environment)."""
    model = model_on_disk(model_on_host(config, env))
    if model is None:
        return None
    v = config.vllm
    return share_warning(model, utilization, total_bytes, v.arg("max-model-len"), v.arg("kv-cache-dtype"))


def model_on_disk(located: tuple[str, dict[str, str]] | None) -> ModelOnDisk | None:
    """The size of the model's safetensors and its config.json, where `command.model_on_host` located them; None when not there."""
    if located is None:
        return None
    files = safetensors_files(*located)
    if not files:
        return None
    weights = 0
    for file in files:
        try:
            weights += file.stat().st_size
        except OSError:
            return None
    return ModelOnDisk(weights, _read_config(files[0].parent / "config.json"))


def _read_config(path: Path) -> Mapping[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
