"""A Hugging Face model as vLLM gets it: from the cache when it is there, downloaded when it is not.

vLLM resolves a repository id through huggingface_hub: the API server reads
config.json (`try_to_load_from_cache`, else a download), and the loader
then fetches the weights (`download_weights_from_hf`: `snapshot_download`,
which finds a complete snapshot in the cache and fetches nothing). The
stand-in looks in the cache it is given, `HF_HUB_CACHE`,
`HUGGINGFACE_HUB_CACHE`, `HF_HOME` or `XDG_CACHE_HOME`, resolved as
huggingface_hub resolves them (gb10d.hfcache), or `--download-dir` for the
weights:

- a snapshot with config.json and the *.safetensors is a hit: nothing is
  printed, as with vLLM;
- otherwise huggingface_hub's byte bars go to stderr, config.json's in the
  API server and one per shard in the loader, and the loader logs
  `Time spent downloading weights for MODEL: S seconds`, which vLLM logs
  after a weights download that took over half a second (count these lines
  to count downloads);
- with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, a miss fails the start
  the way a model vLLM cannot find fails it.

The download is shown, not stored: the stand-in has no weights to write,
and made-up files in a real cache would break the real vLLM that uses it
next, so the next start downloads again. Given none of those variables the
stand-in does not look at all (a test must not depend on the home
directory of whoever runs it) and loads as from a warm cache.
"""

from __future__ import annotations

import argparse
import time
from typing import Mapping

from ..hfcache import cached_snapshot, hub_cache, is_repo_id, offline, weight_files
from .output import Bar, Console, format_bytes_meter
from .settings import GIB, SimSettings

CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
CONFIG_BYTES = 1530
DOWNLOAD_BYTES_PER_S = 250e6  # simulated; a fast link, so tests spend little time downloading
_UPDATES_PER_FILE = 4


def given_cache(args: argparse.Namespace, env: Mapping[str, str], weights: bool) -> str | None:
    """The cache directory a repository id is looked up in, or None when the model is local or no cache is given."""
    if not is_repo_id(args.model):
        return None
    if weights and args.download_dir:
        return str(args.download_dir)
    if not any(env.get(name) for name in CACHE_VARIABLES):
        return None
    return hub_cache(env, env.get("HOME") or "/")


def is_cached(cache: str, args: argparse.Namespace, weights: bool) -> bool:
    """Whether the cache holds what this step needs: config.json, and for the loader the weights too."""
    snapshot = cached_snapshot(cache, args.model, args.revision or "main")
    return snapshot is not None and (not weights or bool(weight_files(snapshot)))


def config_missing(settings: SimSettings, args: argparse.Namespace) -> bool:
    """The API server's look-up of config.json: True when the model must come from the network."""
    cache = given_cache(args, settings.env, weights=False)
    return cache is not None and not is_cached(cache, args, weights=False)


def refused_offline(settings: SimSettings) -> bool:
    """HF_HUB_OFFLINE: huggingface_hub may not fetch what the cache lacks."""
    return offline(settings.env)


def download_config(console: Console, settings: SimSettings) -> None:
    """huggingface_hub's bar for config.json, the first file the API server fetches."""
    _download(console, settings, "config.json", CONFIG_BYTES)


def download_weights(console: Console, settings: SimSettings, args: argparse.Namespace, weights_gib: float, shards: int) -> float | None:
    """The loader's download of a model its cache lacks: one bar per shard; the simulated seconds it took, or None on a hit."""
    cache = given_cache(args, settings.env, weights=True)
    if cache is None or is_cached(cache, args, weights=True):
        return None
    size = int(weights_gib * GIB / shards)
    started = time.monotonic()
    for index in range(1, shards + 1):
        _download(console, settings, f"model-{index:05d}-of-{shards:05d}.safetensors", size)
    took = time.monotonic() - started
    return took / settings.speed if settings.speed else shards * size / DOWNLOAD_BYTES_PER_S


def _download(console: Console, settings: SimSettings, name: str, size: int) -> None:
    bar = Bar(console, name, size, shard_format=False, meter=format_bytes_meter)
    step = size // _UPDATES_PER_FILE
    for index in range(_UPDATES_PER_FILE):
        settings.sleep(step / DOWNLOAD_BYTES_PER_S)
        bar.advance(step if index < _UPDATES_PER_FILE - 1 else size - step * index)
    bar.close()


def weights_line(model: str, seconds: float) -> tuple[str, str]:
    """vLLM's log record after a weights download: (source, message)."""
    return "model_executor/model_loader/weight_utils.py:603", f"Time spent downloading weights for {model}: {seconds:.6f} seconds"

