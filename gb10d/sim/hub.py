"""A Hugging Face model as vLLM gets it: from the cache when it is there, downloaded when it is not.

vLLM resolves a repository id through huggingface_hub: the API server reads
config.json (`try_to_load_from_cache`, else a download), and the loader
then fetches the weights (`download_weights_from_hf`: `snapshot_download`,
which finds a complete snapshot in the cache and fetches nothing). The
stand-in looks in the cache it is given, `HF_HUB_CACHE`,
`HUGGINGFACE_HUB_CACHE`, `HF_HOME` or `XDG_CACHE_HOME`, resolved as
huggingface_hub resolves them, or `--download-dir` for the weights:

- a snapshot with config.json and the *.safetensors is a hit: nothing is
  printed, as with vLLM;
- otherwise huggingface_hub's byte bars go to stderr, config.json's in the
  API server and one per shard in the loader, and the loader logs
  `Time spent downloading weights for MODEL: S seconds`, which vLLM logs
  after a weights download that took over half a second (count these lines
  to count downloads);
- with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, a miss fails the start
  the way a model vLLM cannot find fails it.

The cache's layout is read here from huggingface_hub's own rules
(constants.py, `try_to_load_from_cache`), not through gb10d.base.hfcache: the
stand-in is the other side of every cache test, and a mistake shared by
both sides would pass them all.

The download is shown, not stored: the stand-in has no weights to write,
and made-up files in a real cache would break the real vLLM that uses it
next, so the next start downloads again. Given none of those variables the
stand-in does not look at all (a test must not depend on the home
directory of whoever runs it) and loads as from a warm cache.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Mapping

from .output import Bar, Console, format_bytes_meter
from .settings import GIB, SimSettings

CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
CONFIG_BYTES = 1530
DOWNLOAD_BYTES_PER_S = 250e6  # simulated; a fast link, so tests spend little time downloading
_UPDATES_PER_FILE = 4
# huggingface_hub's validate_repo_id: `name` or `namespace/name`; anything else vLLM takes for a local path.
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")
_ENV_VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def _user_path(path: str, env: Mapping[str, str]) -> str:
    """os.path.expanduser and expandvars as huggingface_hub applies them, against the stand-in's environment."""
    home = env.get("HOME") or "/"
    if path == "~":
        path = home
    elif path.startswith("~/"):
        path = home.rstrip("/") + path[1:]
    return _ENV_VAR.sub(lambda found: env.get(found.group(1) or found.group(2), found.group(0)), path)


def names_a_repo(model: str) -> bool:
    """Whether vLLM hands `model` to huggingface_hub (a repository id) rather than taking it for a local path."""
    return _REPO_ID.match(model) is not None


def hub_dir(env: Mapping[str, str]) -> str:
    """huggingface_hub's HF_HUB_CACHE: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME or ~/.cache."""
    cache_home = env.get("XDG_CACHE_HOME") or "~/.cache"
    hf_home = _user_path(env.get("HF_HOME") or f"{cache_home}/huggingface", env)
    return _user_path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or f"{hf_home}/hub", env)


def snapshot_with_config(cache: str, model: str, revision: str) -> Path | None:
    """`try_to_load_from_cache(model, "config.json")`: a ref names the commit, whose snapshot must hold the file."""
    repo = Path(cache) / ("models--" + model.replace("/", "--"))
    try:
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        snapshot = repo / "snapshots" / commit
        return snapshot if (snapshot / "config.json").is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


def has_weights(snapshot: Path) -> bool:
    """Whether `snapshot_download` would find the *.safetensors there (an unreadable folder has none)."""
    try:
        return any(snapshot.glob("*.safetensors"))
    except OSError:
        return False


def given_cache(args: argparse.Namespace, env: Mapping[str, str], weights: bool) -> str | None:
    """The cache directory a repository id is looked up in, or None when the model is local or no cache is given."""
    if not names_a_repo(args.model):
        return None
    if weights and args.download_dir:
        return str(args.download_dir)
    if not any(env.get(name) for name in CACHE_VARIABLES):
        return None
    return hub_dir(env)


def is_cached(cache: str, args: argparse.Namespace, weights: bool) -> bool:
    """Whether the cache holds what this step needs: config.json, and for the loader the weights too."""
    snapshot = snapshot_with_config(cache, args.model, args.revision or "main")
    return snapshot is not None and (not weights or has_weights(snapshot))


def config_missing(settings: SimSettings, args: argparse.Namespace) -> bool:
    """The API server's look-up of config.json: True when the model must come from the network."""
    cache = given_cache(args, settings.env, weights=False)
    return cache is not None and not is_cached(cache, args, weights=False)


def refused_offline(settings: SimSettings) -> bool:
    """HF_HUB_OFFLINE: huggingface_hub may not fetch what the cache lacks."""
    value = settings.env.get("HF_HUB_OFFLINE") or settings.env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


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

