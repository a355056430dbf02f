"""The one way a test makes gb10d's config, in memory (make_config) or as a gb10d.toml (write_config).

A test names only the tables and keys it is about; the rest is the smallest [vllm] gb10d accepts (a program and a
model), so that a change to what every config needs is made here once. A test file whose cases share more (a
utilization, a [startup] table) says so once, as a layer: `config = partial(make_config, {"startup": {...}})`.
A test about a file's layout (line numbers, comments, drop-ins) writes its text itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import tomli_w

from gb10d.base.config import Config
from gb10d.base.configload import parse_config

SMALLEST: dict[str, dict[str, Any]] = {"vllm": {"executable": "/usr/bin/vllm", "model": "Qwen/Qwen3.6-27B-FP8"}}
# gb10d runs vLLM from one of these; a layer that names one replaces the one named before it.
PROGRAMS = frozenset({"executable", "venv", "image"})


def merged(*layers: Mapping[str, Mapping[str, Any]], **tables: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """SMALLEST, then each layer, then the tables, merged table by table and key by key (a key's value is replaced whole)."""
    data: dict[str, dict[str, Any]] = {}
    for layer in (SMALLEST, *layers, tables):
        for name, table in layer.items():
            into = data.setdefault(name, {})
            if name == "vllm" and PROGRAMS & table.keys():
                for program in PROGRAMS:
                    into.pop(program, None)
            into.update(table)
    return data


def make_config(*layers: Mapping[str, Mapping[str, Any]], **tables: Mapping[str, Any]) -> Config:
    """The merged tables validated as gb10d validates a file: a mistake in a test's config is a ConfigError naming the key."""
    return parse_config(merged(*layers, **tables))


def write_config(path: Path, *layers: Mapping[str, Mapping[str, Any]], **tables: Mapping[str, Any]) -> Path:
    """The merged tables written as TOML to path (its folder made), unchecked: a test may write what gb10d must refuse."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(merged(*layers, **tables)))
    return path
