"""Loading gb10d.toml: the main file and its drop-ins merged, validated, and errors that point at a line.

Loading never raises anything but `ConfigError`, whose problems each name
the file, the line (when the key is found in the text), the dotted key and
the fix, so the CLI can print them and exit 78 without a traceback.

Drop-ins override the main file, merged in name order. Every effective value
remembers the file it came from, for `--explain` and for error messages that
name the drop-in that set a bad value.
"""

from __future__ import annotations

import difflib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from .config import PROGRAM_KEYS, Config
from .configfile import default_config_path, dotted_key, dropin_dir_for, dropins, locate_key, read_toml
from .configtable import Table
from .errors import ConfigError, ConfigProblem
from .flags import normalize_flag
from .frontconfig import FrontSection
from .instance import fill_defaults

DEFAULT_SOURCE = "default"


def _known_keys(loc: tuple[str | int, ...]) -> list[str]:
    """The valid keys of the table that `loc` points into, for did-you-mean."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field_info = model.model_fields.get(str(part))
        # An optional table (`cluster: ClusterSection | None`) is its model for did-you-mean.
        kinds = get_args(field_info.annotation) or (field_info.annotation,) if field_info is not None else ()
        tables = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if not tables:
            return []
        model = tables[0]
    return list(model.model_fields)


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "str": "a string",
    "list": "a list",
    "dict": "a table",
    "model": "a table",
    "path": "a path string",
}


def _describe(error: ErrorDetails) -> str:
    """An operator-facing sentence for one pydantic error."""
    kind: str = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    got = f" (got {_shown(value)})" if not isinstance(value, dict) else ""
    if kind == "missing":
        if tuple(error["loc"]) == ("vllm",):
            return "the [vllm] table is missing; it needs at least model and one of venv, executable or image"
        return "is required"
    if kind == "extra_forbidden":
        if len(error["loc"]) == 1 and isinstance(value, dict):
            return f"unknown table [{error['loc'][0]}]; gb10d's tables are {', '.join(f'[{t}]' for t in Config.model_fields)}"
        return "unknown key"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    for op, word in (("greater_than_equal", ">="), ("greater_than", ">"), ("less_than_equal", "<="), ("less_than", "<")):
        if kind == op:
            bound = next(iter(ctx.values()), "?")
            return f"must be {word} {bound}{got}"
    for prefix, words in _TYPE_WORDS.items():
        if kind.startswith(prefix):
            return f"must be {words}{got}"
    return f"{error['msg']}{got}"


def _shown(value: Any) -> str:
    """A value as the user wrote it in TOML, so `true` is not shown as Python's `True`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _is_union_tag(part: str | int) -> bool:
    """pydantic names union members and validators in error locations; they mean nothing to an operator."""
    return isinstance(part, str) and (part in ("str", "list[str]") or part.startswith("function-"))


@dataclass(frozen=True, kw_only=True)
class _Located(ABC):
    """Effective settings with the files read (main file first) and the (file, line) of each dotted key some file set,
    for problems located at their line and for --explain."""

    files: tuple[Path, ...]
    locations: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)  # defaults of its own an instance got, and why

    @abstractmethod
    def tables(self) -> Iterator[tuple[str, Table]]:
        """(name, table) of the effective settings, in schema order."""

    def location_of(self, dotted: str) -> tuple[str, int | None] | None:
        """(file, line) that set this key or a table holding it; None for a default."""
        probe = dotted
        while probe:
            if probe in self.locations:
                return self.locations[probe]
            probe = probe.rpartition(".")[0]
        return None

    def problem(self, dotted: str, message: str) -> ConfigProblem:
        """A problem with an effective value, located in the file that set it."""
        file, line = self.location_of(dotted) or (str(self.files[0]), None)
        return ConfigProblem(file, dotted, message, line=line)

    def source_of(self, dotted: str) -> str:
        """`FILE:LINE` of the file that set this key, else "default"."""
        where = self.location_of(dotted)
        if where is None:
            return self.derived.get(dotted, DEFAULT_SOURCE)
        file, line = where
        return f"{file}:{line}" if line else file

    def explain(self) -> list[tuple[str, Any, str]]:
        """(dotted key, effective value, source) for every setting, in schema order."""
        rows: list[tuple[str, Any, str]] = []
        for section_name, section in self.tables():
            for key in type(section).model_fields:
                value = getattr(section, key)
                dotted = f"{section_name}.{key}"
                if isinstance(value, dict) and value:
                    rows += [(f"{dotted}.{k}", v, self.source_of(f"{dotted}.{k}")) for k, v in value.items()]
                else:
                    rows.append((dotted, value, self.source_of(dotted)))
        return rows


@dataclass(frozen=True, kw_only=True)
class LoadedConfig(_Located):
    """A merged config with where each value came from.

    `locations` maps dotted keys (`vllm.port`, `vllm.args.max-model-len`) of
    the values set in some file to (file, line); keys missing from it are
    defaults. `files` lists the files read, main file first, so a watcher
    knows what to watch.
    """

    config: Config

    def tables(self) -> Iterator[tuple[str, Table]]:
        return self.config.tables()


@dataclass
class _Layers:
    """The merge of the main file and its drop-ins, remembering who set what."""

    data: dict[str, Any] = field(default_factory=dict)
    origin: dict[tuple[str, ...], int] = field(default_factory=dict)  # key path -> index into files
    files: list[Path] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def add(self, path: Path, data: dict[str, Any], text: str) -> None:
        self.files.append(path)
        self.texts.append(text)
        self._merge(self.data, data, ())

    def _forget(self, prefix: tuple[str, ...]) -> None:
        for key in [k for k in self.origin if k[: len(prefix)] == prefix]:
            del self.origin[key]

    def _merge(self, base: dict[str, Any], overlay: dict[str, Any], path: tuple[str, ...]) -> None:
        index = len(self.files) - 1
        for key, value in overlay.items():
            here = path + (key,)
            if path == ("vllm", "args"):
                # A drop-in's max-model-len overrides the main file's max_model_len.
                # Two spellings within one file stay, so validation can report them.
                earlier = [k for k in base if normalize_flag(k) == normalize_flag(key) and self.origin.get(path + (k,)) != index]
                for old in earlier:
                    del base[old]
                    self._forget(path + (old,))
            if path == ("vllm",) and key in PROGRAM_KEYS:
                # Choosing the program in a drop-in replaces the other ways of choosing it.
                for other in PROGRAM_KEYS:
                    if other != key and other not in overlay and other in base:
                        del base[other]
                        self._forget(path + (other,))
            is_arg_value = path == ("vllm", "args")
            if isinstance(value, dict) and not is_arg_value:
                if not isinstance(base.get(key), dict):
                    base[key] = {}
                    self._forget(here)
                self._merge(base[key], value, here)
                if not value:
                    self.origin.setdefault(here, index)
            else:
                self._forget(here)
                base[key] = value
                self.origin[here] = index

    def where(self, loc: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
        """Which file to blame for a problem at `loc`, and the key as spelled there."""
        setters = [(i, k) for k, i in self.origin.items() if loc[: len(k)] == k]
        if setters:
            index, key = max(setters, key=lambda c: (c[0], len(c[1])))
            return index, key
        # A table-level problem (a missing key, two keys that clash): blame the first file writing into it.
        inside = [i for k, i in self.origin.items() if k[: len(loc)] == loc]
        return (min(inside) if inside else 0), loc

    def location(self, key: tuple[str, ...]) -> tuple[str, int | None]:
        index = self.origin[key]
        return str(self.files[index]), locate_key(self.texts[index], key)

    def problem(self, loc: tuple[str, ...], message: str) -> ConfigProblem:
        index, key = self.where(loc)
        line = locate_key(self.texts[index], key) if loc else None
        return ConfigProblem(str(self.files[index]), dotted_key(loc), message, line=line)
def _problems_from(exc: ValidationError, layers: _Layers) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    seen: set[tuple[str, str]] = set()
    for error in exc.errors(include_url=False):
        loc = tuple(str(p) for p in error["loc"] if not _is_union_tag(p))
        keyed = (error.get("ctx") or {}).get("problems")
        items = [(loc + (k if isinstance(k, tuple) else (k,)), m) for k, m in keyed] if keyed else [(loc, _describe(error))]
        for where, message in items:
            if error["type"] == "extra_forbidden":
                close = difflib.get_close_matches(where[-1], _known_keys(where), n=1)
                if close:
                    message += f"; did you mean {'.'.join(where[:-1] + (close[0],))}?"
                elif len(where) > 1:
                    message += "; remove it"
            if (".".join(where), message) in seen:
                continue
            seen.add((".".join(where), message))
            problems.append(layers.problem(where, message))
    return _join_alternatives(problems)


def _join_alternatives(problems: list[ConfigProblem]) -> list[ConfigProblem]:
    """A union type fails once per member; say "must be a string or a list (got 5)" once instead."""
    joined: list[ConfigProblem] = []
    for problem in problems:
        last = joined[-1] if joined else None
        this = re.fullmatch(r"must be (.+) (\(got .*\))", problem.message)
        before = re.fullmatch(r"must be (.+) (\(got .*\))", last.message) if last else None
        if last and this and before and last.key == problem.key and this.group(2) == before.group(2):
            joined[-1] = replace(last, message=f"must be {before.group(1)} or {this.group(1)} {this.group(2)}")
        else:
            joined.append(problem)
    return joined


def parse_config(data: dict[str, Any], shown: str = "<config>", text: str = "") -> Config:
    """Validate already-parsed TOML data, raising ConfigError with located problems."""
    layers = _Layers()
    layers.add(Path(shown), data, text)
    return _validate(layers)


def _validate(layers: _Layers) -> Config:
    if not layers.data:
        raise ConfigError([ConfigProblem(str(layers.files[0]), "", "is empty; it needs at least a [vllm] table with model and one of venv, executable or image")])
    try:
        return Config.model_validate(layers.data)
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, layers)) from None


def _read_layers(path: Path, dropin_dir: Path | None = None) -> _Layers:
    """The main file and its drop-ins merged; a ConfigError names every file that cannot be read or parsed."""
    layers = _Layers()
    problems: list[ConfigProblem] = []
    for file in [path, *dropins(dropin_dir or dropin_dir_for(path))]:
        try:
            data, text = read_toml(file)
        except ConfigError as exc:
            problems += exc.problems
            continue
        layers.add(file, data, text)
    if problems:
        raise ConfigError(problems)
    return layers


def _locations(layers: _Layers) -> dict[str, tuple[str, int | None]]:
    return {".".join(key): layers.location(key) for key in layers.origin}


def load_config_explained(path: Path | None = None, dropin_dir: Path | None = None) -> LoadedConfig:
    """Read the main file and its drop-ins, merge and validate them, remembering each value's file.

    Drop-ins are merged over the main file in name order: tables merge key
    by key, arrays and other values are replaced, `[vllm.args]` keys match
    whatever their `-`/`_` spelling. Every file is read before any is
    validated, so syntax errors in several files are reported together.
    """
    path = path or default_config_path()
    layers = _read_layers(path, dropin_dir)
    derived: dict[str, str] = {}
    if layers.data:
        derived = fill_defaults(layers.data, path)
    config = _validate(layers)
    return LoadedConfig(config=config, files=tuple(layers.files), locations=_locations(layers), derived=derived)


def load_config(path: Path | None = None, dropin_dir: Path | None = None) -> Config:
    """Read, merge and validate the config file and its drop-ins; the only error raised is ConfigError."""
    return load_config_explained(path, dropin_dir).config


# --- the front's config ------------------------------------------------------------------


def tables_of(path: Path) -> frozenset[str]:
    """The tables the config file and its drop-ins set together; a ConfigError when one cannot be read."""
    return frozenset(_read_layers(path).data)


def front_only(path: Path) -> bool:
    """Whether the config is the front's alone: `[front]` and no `[vllm]`, so it runs no model itself.

    False when the files cannot be read: the command's own loading says why.
    """
    try:
        tables = tables_of(path)
    except ConfigError:
        return False
    return "front" in tables and "vllm" not in tables


class _FrontFile(Table):
    """The front's view of its config: `[front]` alone; the rest belongs to the gb10d instance the file may also run."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True, strict=True)
    front: FrontSection = Field(default_factory=FrontSection)


@dataclass(frozen=True, kw_only=True)
class LoadedFront(_Located):
    """`[front]` with where each value came from, for problems and warnings located at their line."""

    front: FrontSection

    def tables(self) -> Iterator[tuple[str, Table]]:
        yield "front", self.front


def load_front_explained(path: Path) -> LoadedFront:
    """`[front]` of the config and its drop-ins (defaults when the file or the table is absent), problems located like
    load_config's.

    In the front's own config (no `[vllm]`) another table is a problem: nothing would read it, as the instances read
    only their own files. Beside `[vllm]` the other tables belong to the instance that file runs.
    """
    if not path.exists():
        return LoadedFront(front=FrontSection(), files=(path,))
    layers = _read_layers(path)
    problems: list[ConfigProblem] = []
    front: FrontSection | None = None
    try:
        front = _FrontFile.model_validate(layers.data).front
    except ValidationError as exc:
        problems += _problems_from(exc, layers)
    if "vllm" not in layers.data:
        problems += [layers.problem((table,), _stray_table(table, front)) for table in layers.data if table != "front"]
    if problems or front is None:
        raise ConfigError(problems)
    return LoadedFront(front=front, files=tuple(layers.files), locations=_locations(layers))


def _stray_table(table: str, front: FrontSection | None) -> str:
    """Why a table other than [front] in the front's own config is refused, and where it belongs."""
    if table in Config.model_fields:
        where = front.instances_dir if front is not None else "[front] instances_dir"
        return (f"is a table of a gb10d instance, and this config ([front] and no [vllm]) is the front's: nothing reads it here; "
                f"move it into the instance configs in {where}, or remove it")
    close = difflib.get_close_matches(table, ["front"], n=1)
    return "unknown table; the front's config has only [front]" + ("; did you mean front?" if close else "; remove it")


def load_front(path: Path) -> FrontSection:
    """`[front]` of `path` and its drop-ins (defaults when the file or the table is absent); see load_front_explained."""
    return load_front_explained(path).front
