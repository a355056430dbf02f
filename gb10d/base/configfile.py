"""Where the config files are and reading one of them: the main file, its drop-in directory, TOML syntax errors and key lines.

The main file is `$GB10D_CONFIG` or /etc/gb10d.toml; its drop-ins are
`<config without .toml>.d/*.toml` (`/etc/gb10d.d/` for `/etc/gb10d.toml`).
Apart from validation because the watcher, the command line and the front
need the files without the schema, and the container's name (command.py)
depends on the default path.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from .errors import ConfigError, ConfigProblem

DEFAULT_CONFIG_PATH = Path("/etc/gb10d.toml")
CONFIG_ENV = "GB10D_CONFIG"


# Byte-order marks of the encodings an editor may save in instead of UTF-8 (UTF-32's first: it begins like UTF-16's).
_OTHER_ENCODINGS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def default_config_path() -> Path:
    """`$GB10D_CONFIG` when set, else /etc/gb10d.toml."""
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def dropin_dir_for(path: Path) -> Path:
    """The drop-in directory of a config file: `/etc/gb10d.toml` -> `/etc/gb10d.d`, `x/foo.toml` -> `x/foo.d`."""
    if path.suffix == ".toml":
        return path.with_suffix(".d")
    return path.with_name(path.name + ".d")


def read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Read and parse one TOML file, or raise ConfigError naming the file and the position."""
    shown = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([ConfigProblem(shown, "", f"file not found; create it, or point --config or ${CONFIG_ENV} at the right file")]) from None
    except IsADirectoryError:
        raise ConfigError([ConfigProblem(shown, "", "is a directory, not a TOML file; pass the file itself with --config")]) from None
    except PermissionError:
        raise ConfigError([ConfigProblem(shown, "", f"permission denied; make it readable by the user running gb10d (uid {os.getuid()})")]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(shown, "", f"cannot read: {exc.strerror or exc}")]) from None
    other = next((name for bom, name in _OTHER_ENCODINGS if raw.startswith(bom)), None)
    if other is not None:
        raise ConfigError([ConfigProblem(shown, "", f"is {other} text (it starts with a {other} byte-order mark); save it as UTF-8", line=1)])
    try:
        # An editor's UTF-8 byte-order mark is no part of the text: tomllib would call line 1 an invalid statement.
        text = raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError([ConfigProblem(shown, "", f"not UTF-8 text (invalid byte at offset {exc.start}); is this really a TOML file?", line=line)]) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise ConfigError([ConfigProblem(shown, "", "contains NUL bytes; is this really a TOML file?", line=line)])
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([_syntax_problem(shown, text, exc)]) from None
    return data, text


def _syntax_problem(shown: str, text: str, exc: tomllib.TOMLDecodeError) -> ConfigProblem:
    """Turn tomllib's "msg (at line L, column C)" into a located problem."""
    message = str(exc)
    match = re.search(r"\(at line (\d+), column (\d+)\)$", message)
    if match:
        return ConfigProblem(
            shown, "", f"TOML syntax error: {message[: match.start()].strip()}", int(match.group(1)), int(match.group(2))
        )
    match = re.search(r"\(at end of document\)$", message)
    if match:
        return ConfigProblem(shown, "", f"TOML syntax error: {message[: match.start()].strip()} at end of file", text.count("\n") + 1)
    return ConfigProblem(shown, "", f"TOML syntax error: {message}")


def locate_key(text: str, dotted: str | tuple[str, ...]) -> int | None:
    """The 1-based line where a key (e.g. "vllm.port") is set in `text`, if it can be found.

    Handles `[table]` headers, dotted keys (`vllm.port = 1`), quoted keys and
    inline tables, which covers how people write gb10d.toml; returns the
    table's header line when the key itself is missing (a required key), or
    None. Pass a tuple when a key part itself contains a dot.
    """
    parts = tuple(dotted.split(".")) if isinstance(dotted, str) else dotted
    table: list[str] = []
    header_lines: dict[tuple[str, ...], int] = {}
    inline: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?", stripped)
        if header:
            table = [_unquote(p) for p in _split_dotted(header.group(1))]
            header_lines.setdefault(tuple(table), number)
            if tuple(table) == parts:
                return number
            continue
        assignment = re.match(r'^((?:"[^"]*"|\'[^\']*\'|[A-Za-z0-9_.\- ])+?)\s*=', stripped)
        if not assignment:
            continue
        key = tuple(table + [_unquote(p) for p in _split_dotted(assignment.group(1))])
        if key[: len(parts)] == parts:
            return number
        if inline is None and parts[: len(key)] == key:
            inline = number  # the key lives inside an inline table or array set on this line
    if inline is not None:
        return inline
    for length in range(len(parts) - 1, 0, -1):
        if tuple(parts[:length]) in header_lines:
            return header_lines[tuple(parts[:length])]
    return None


def dotted_key(parts: tuple[str, ...]) -> str:
    """A key path as TOML spells it, for messages: bare parts as they are, others quoted (`vllm.env."A B"`, `""`).

    A key that is empty, or holds a space, a dot or a newline, would otherwise vanish from the message, read as two
    keys, or break the message over two lines.
    """
    return ".".join(p if _BARE_KEY.fullmatch(p) else json.dumps(p, ensure_ascii=False) for p in parts)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _split_dotted(key: str) -> list[str]:
    return [p.strip() for p in re.findall(r'"[^"]*"|\'[^\']*\'|[^.]+', key)]


def _unquote(part: str) -> str:
    if len(part) >= 2 and part[0] == part[-1] == '"':
        # A basic string's escapes (`"\u0014"`, `"a\tb"`) are JSON's, but for TOML's \UXXXXXXXX and \e.
        try:
            return str(json.loads(part))
        except ValueError:
            return part[1:-1]
    if len(part) >= 2 and part[0] == part[-1] == "'":
        return part[1:-1]
    return part


def dropins(directory: Path) -> list[Path]:
    """The drop-in files in name order; a missing directory simply means none."""
    try:
        entries = sorted(p for p in directory.iterdir() if p.suffix == ".toml" and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError([ConfigProblem(str(directory), "", "is not a directory; drop-ins go in a directory of *.toml files")]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(str(directory), "", f"cannot list drop-ins: {exc.strerror or exc}")]) from None
    return entries
