"""What each gb10d instance of a machine holds alone, and the defaults that keep a second instance off the first's.

A second model runs from `/etc/gb10d/NAME.toml` as `gb10d@NAME`. Copied
from the first config, it would share the first's state file (so `gb10d
status` of the first would read the second's), its learned file, its
metrics listener and, for an image, its container name. So an instance's
defaults are its own: `/run/gb10d-NAME/state.json` and
`/var/lib/gb10d/NAME/state.toml` (the template unit's RuntimeDirectory= and
StateDirectory=), a metrics port from 9401 to 9499 derived from NAME, and
the container `gb10d-NAME` (command.container_name).

What an instance holds (its API address, metrics listener, state and
learned files, container) goes into its record in the memory ledger; a
start or `gb10d check-config` that would take one that a living instance
holds is refused, naming both instances. Pure: the ledger reads and writes.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .command import container_name
from .config import Config

INSTANCE_DIR = Path("/etc/gb10d")
# The package's unit and the system user it runs as (units/gb10d.service).
MAIN_UNIT = "gb10d.service"
SYSTEM_USER = "gb10d"
METRICS_HOST = "127.0.0.1"
_FIRST_METRICS_PORT = 9401  # 9400 is the main instance's
_METRICS_PORTS = 99
# An address on every interface takes the port on each of them.
_ANY_HOST = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def instance_of(config: Path, instance_dir: Path = INSTANCE_DIR) -> str | None:
    """NAME for `/etc/gb10d/NAME.toml` (the config of gb10d@NAME), None for any other file (its defaults stay)."""
    if config.parent == instance_dir and config.suffix == ".toml":
        return config.stem
    return None


def metrics_port(name: str) -> int:
    """The default metrics port of instance NAME: the same on every machine, 9401 to 9499."""
    return _FIRST_METRICS_PORT + zlib.crc32(name.encode()) % _METRICS_PORTS


def derived_defaults(name: str) -> dict[tuple[str, str], str]:
    """The defaults of instance NAME that differ from the main instance's, by (table, key)."""
    return {
        ("daemon", "state_file"): f"/run/gb10d-{name}/state.json",
        ("daemon", "learned_file"): f"/var/lib/gb10d/{name}/state.toml",
        ("metrics", "listen"): f"{METRICS_HOST}:{metrics_port(name)}",
    }


def fill_defaults(data: dict[str, Any], config: Path) -> dict[str, str]:
    """Put an instance's own defaults into the merged TOML data wherever no file set the key.

    Returns each dotted key filled with where its value came from, for `check-config --explain`.
    """
    name = instance_of(config)
    if name is None:
        return {}
    filled = {}
    for (table, key), value in derived_defaults(name).items():
        section = data.setdefault(table, {})
        if isinstance(section, dict) and key not in section:
            section[key] = value
            filled[f"{table}.{key}"] = f"default of the instance {name}"
    return filled


# --- what an instance holds ------------------------------------------------------------

def holds(config: Config, path: Path) -> dict[str, str]:
    """What the instance of `config` (read from `path`) holds, by its config key: addresses as HOST:PORT, files as paths."""
    held = {
        "vllm.port": f"{config.vllm.host}:{config.vllm.port}",
        "daemon.state_file": str(config.daemon.state_file),
        "daemon.learned_file": str(config.daemon.learned_file),
    }
    if config.metrics.address is not None:
        held["metrics.listen"] = config.metrics.listen
    if config.vllm.image is not None:
        held["container.name"] = container_name(config.container, path)
    return held


def _same(key: str, mine: str, theirs: str) -> bool:
    if key in ("vllm.port", "metrics.listen"):
        my_host, _, my_port = mine.rpartition(":")
        their_host, _, their_port = theirs.rpartition(":")
        return my_port == their_port and (my_host == their_host or my_host in _ANY_HOST or their_host in _ANY_HOST)
    return mine == theirs


@dataclass(frozen=True)
class Clash:
    """One thing this instance would take that another living instance holds."""

    key: str
    value: str
    other: str  # the other instance's name
    other_config: str
    other_pid: int

    def describe(self, me: str, own_default: bool) -> str:
        """`/run/gb10d/state.json of gb10d@second is held by the running instance gb10d (/etc/gb10d.toml, pid 42); ...`.

        `own_default`: the config is an instance's (`/etc/gb10d/NAME.toml`), whose files and metrics port are its
        own unless set, so leaving the key out is a fix too.
        """
        other = self.other if self.other == self.other_config else f"{self.other} ({self.other_config}"
        other += f", pid {self.other_pid})" if other != self.other else f" (pid {self.other_pid})"
        leave_out = own_default and self.key in ("daemon.state_file", "daemon.learned_file", "metrics.listen")
        return (
            f"{self.value} of {me} is held by the running instance {other}; two instances would {_WHY[self.key]}; "
            f"set {self.key} to one of its own" + (" or leave it out (each instance has its own by default)" if leave_out else "")
        )


_WHY = {
    "vllm.port": "serve on one port",
    "metrics.listen": "listen for scrapes on one port",
    "daemon.state_file": "write one state file, and gb10d status would show the wrong one",
    "daemon.learned_file": "overwrite each other's learned settings",
    "container.name": "remove each other's container",
}


def clashes(mine: Mapping[str, str], others: Sequence[tuple[str, str, int, Mapping[str, str]]]) -> list[Clash]:
    """What of `mine` another living instance (name, config, pid, its holds) already holds."""
    return [
        Clash(key, value, name, config, pid)
        for name, config, pid, theirs in others
        for key, value in mine.items()
        if key in theirs and _same(key, value, theirs[key])
    ]
