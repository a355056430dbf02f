"""What a start script was found to say (`Findings`), and the gb10d.toml it becomes (`Imported`, `render`).

Every input form (a shell script, a `docker run` line, a compose file) collects into the same findings, so the
tables, the notes and warnings the operator reads, and the text written out are decided once, here.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from ...base.command import DRAIN_MARGIN_S
from ...base.configload import parse_config
from ...base.errors import ConfigError


@dataclass
class Findings:
    """What the script says, being collected line by line."""

    vllm: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    venv: str | None = None
    cwd: str | None = None
    found: int = 0
    container: dict[str, Any] = field(default_factory=dict)

    def absolute(self, path: str, line: int, what: str) -> str:
        """An absolute path, resolved against the script's `cd` when needed and possible."""
        if path.startswith("/"):
            return posixpath.normpath(path)
        if self.cwd is not None:
            return posixpath.normpath(posixpath.join(self.cwd, path))
        if path.startswith(("$", "~")):
            return path  # already reported as unset, or as a home directory not known
        self.warnings.append(
            f"line {line}: {what} {path!r} is relative to the directory the script was started from; "
            "write the absolute path (gb10d runs from /)"
        )
        return path


@dataclass(frozen=True)
class Imported:
    """The gb10d.toml tables read from a script, and what the operator must know about them."""

    data: dict[str, Any]
    notes: list[str]
    warnings: list[str]


def import_script_result(result: Findings) -> Imported:
    """The gb10d.toml tables of what was read, with the notes and warnings collected on the way."""
    vllm: dict[str, Any] = {}
    for key in ("model", "served_model_name"):
        if key in result.vllm:
            vllm[key] = result.vllm[key]
    if result.venv is not None:
        vllm["venv"] = result.venv
    elif "executable" in result.vllm:
        vllm["executable"] = result.vllm["executable"]
    elif "image" in result.vllm:
        vllm["image"] = result.vllm["image"]
    for key in ("host", "port", "gpu_memory_utilization"):
        if key in result.vllm:
            vllm[key] = result.vllm[key]
    if "gpu_memory_utilization" not in vllm:
        result.notes.append("the script sets no --gpu-memory-utilization; gb10d passes its default, 0.9 (vLLM's own default is 0.92)")
    if result.extra_args:
        vllm["extra_args"] = result.extra_args
    if result.args:
        vllm["args"] = result.args
    if result.env:
        vllm["env"] = result.env
    for key in ("env_file",):
        if key in result.vllm:
            vllm[key] = result.vllm[key]
    notes = list(result.notes)
    if result.ignored:
        notes.append("ignored, no effect on vLLM under gb10d: " + ", ".join(result.ignored))
    data: dict[str, Any] = {"vllm": vllm}
    if result.container:
        data["container"] = result.container
    drain = result.args.get("shutdown-timeout")
    if isinstance(drain, (int, float)) and not isinstance(drain, bool) and drain >= 0:
        # gb10d passes --shutdown-timeout itself, from the time it gives a stop: the drain asked becomes that time.
        del result.args["shutdown-timeout"]
        if not result.args:
            vllm.pop("args", None)
        data["daemon"] = {"stop_timeout_s": drain + DRAIN_MARGIN_S}
        notes.append(f"--shutdown-timeout {drain} is daemon.stop_timeout_s = {drain + DRAIN_MARGIN_S:g}: gb10d gives vLLM "
                     f"--shutdown-timeout of that less {DRAIN_MARGIN_S:g} s to finish its requests when it stops")
    return Imported(data, notes, list(dict.fromkeys(result.warnings)))


def render(imported: Imported, shown: str) -> str:
    """gb10d.toml text: a header of notes and warnings, then the tables written by tomli-w."""
    header = [
        f"# gb10d.toml imported from {shown} by gb10d import-script.",
        "# Check it with:   gb10d check-config --config THIS_FILE",
        "# Compare it with: gb10d print-command --config THIS_FILE",
        "# Tables not written here ([startup], [memory], [restart], [liveness], [metrics], [daemon])",
        "# keep their defaults; the shipped /etc/gb10d.toml describes every key.",
    ]
    warnings = imported.warnings + refusals(imported.data)
    if imported.notes or warnings:
        header.append("#")
    # A note may quote the script's text, newlines and escapes too: each stays one comment line, or the TOML below breaks.
    header += [f"# note: {_one_line(n)}" for n in imported.notes]
    header += [f"# warning: {_one_line(w)}" for w in warnings]
    return "\n".join(header) + "\n\n" + tomli_w.dumps(imported.data)


def _one_line(text: str) -> str:
    """`text` as TOML allows in a comment: its control characters but tab written as escapes (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: {"\n": "\\n", "\r": "\\r"}.get(m.group(), f"\\x{ord(m.group()):02x}"), text)


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def refusals(data: dict[str, Any]) -> list[str]:
    """What check-config will refuse in these tables as written: a script's value gb10d cannot take (a host with a
    space, an image from an unset variable) is said, not left for check-config to find."""
    try:
        parse_config(data)
    except ConfigError as exc:
        return [f"as written, check-config refuses {p.key}: {p.message}" for p in exc.problems]
    return []
