"""A start script's variables and the expansion of its words with them: `$X`, `${X:-default}`, `~`, `$HOME`.

The shell's state (what is set, exported, used, or unknown) is kept apart from the recognition of the vLLM command
so that every command, wherever it appears, is expanded the same way; `shlex` then unquotes and splits each
expanded word. What the script alone cannot tell (an unset variable, a command substitution, the home of whoever
ran it) is kept as written and reported, never run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from .shellsyntax import matching_bracket

# A shell variable's name, as `$NAME` and `export NAME` take it.
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ScriptOwner:
    """Whose script it is: `~` and `$HOME` in it mean this home, `~user` the home `lookup` gives."""

    name: str
    home: str
    lookup: Callable[[str], str | None] = lambda _user: None

    def home_of(self, user: str) -> str | None:
        return self.home if user == self.name else self.lookup(user)


@dataclass
class Expansion:
    """An expanded word: its fields, and what could not be known from the script."""

    fields: list[str]
    missing: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


class Shell:
    """The variables the script has set so far, and the expansion of words with them."""

    def __init__(self, owner: ScriptOwner | None = None) -> None:
        self.variables: dict[str, str] = {}
        self.exported: set[str] = set()
        self.referenced: set[str] = set()
        # Variables whose value came from something unknown, so using them is just as unknown.
        self.unknown: dict[str, list[str]] = {}
        self.owner = owner
        # What was replaced by a home directory: `~`, `~bob`, `$HOME`; said once, in one note.
        self.homes_used: dict[str, str] = {}
        if owner is not None:
            self.variables["HOME"] = owner.home

    def assign(self, name: str, expanded: Expansion) -> None:
        """Set a variable to an expanded value, remembering what in it could not be known."""
        self.variables[name] = " ".join(expanded.fields)
        self.unknown[name] = expanded.missing + expanded.unsupported

    def expand(self, raw: str) -> Expansion:
        """Expand `$X`, `${X}`, `${X:-d}` and friends as the shell would, then unquote and split with shlex."""
        missing: list[str] = []
        unsupported: list[str] = []
        out: list[str] = []
        i, n = 0, len(raw)
        quoted = False
        if raw.startswith("~"):
            i = self._tilde(raw, out, missing)
        while i < n:
            c = raw[i]
            if c == "'" and not quoted:
                end = raw.find("'", i + 1)
                end = n - 1 if end < 0 else end
                out.append(raw[i : end + 1])
                i = end + 1
            elif c == '"':
                quoted = not quoted
                out.append(c)
                i += 1
            elif c == "\\":
                # In "...", bash drops the backslash of \$ and \`; shlex would keep it.
                out.append(raw[i + 1] if quoted and raw[i + 1 : i + 2] in ("$", "`") else raw[i : i + 2])
                i += 2
            elif c == "`" or raw.startswith("$(", i):
                end = raw.find("`", i + 1) if c == "`" else matching_bracket(raw, i + 1, "(", ")")
                end = n - 1 if end < 0 else end
                unsupported.append(raw[i : end + 1])
                out.append(_escape(raw[i : end + 1], quoted))
                i = end + 1
            elif c == "$" and i + 1 < n:
                value, i = self._parameter(raw, i, quoted, missing, unsupported)
                out.append(value)
            else:
                out.append(c)
                i += 1
        try:
            fields = shlex.split("".join(out))
        except ValueError:
            unsupported.append(raw)
            fields = [raw]
        return Expansion(fields, missing, unsupported)

    def _referenced(self, name: str) -> None:
        self.referenced.add(name)
        if name == "HOME" and self.owner is not None and self.variables.get("HOME") == self.owner.home:
            self.homes_used["$HOME"] = self.owner.home

    def _tilde(self, raw: str, out: list[str], missing: list[str]) -> int:
        """Replace a leading `~` or `~user` by that home, as bash does; the index after it (0 when unknown)."""
        match = re.match(r"~([A-Za-z0-9_][A-Za-z0-9_.-]*)?(?=/|$)", raw)
        home = None
        if match and self.owner is not None:
            home = self.owner.home_of(match.group(1)) if match.group(1) else self.owner.home
        if match is None or home is None:
            missing.append("~ (the home directory of whoever ran the script)")
            return 0
        self.homes_used[match.group(0)] = home
        out.append(_escape(home, False))
        return match.end()

    def _parameter(self, raw: str, i: int, quoted: bool, missing: list[str], unsupported: list[str]) -> tuple[str, int]:
        """The escaped value of the `$...` starting at `i`, and the index after it."""
        if raw[i + 1] == "{":
            end = matching_bracket(raw, i + 1, "{", "}")
            if end < 0:
                unsupported.append(raw[i:])
                return _escape(raw[i:], quoted), len(raw)
            inner = raw[i + 2 : end]
            match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=+])(.*))?", inner, re.DOTALL)
            if not match:
                unsupported.append(raw[i : end + 1])
                return _escape(raw[i : end + 1], quoted), end + 1
            name, op, word = match.group(1), match.group(2), match.group(3)
            self._referenced(name)
            missing += self.unknown.get(name, [])
            value = self.variables.get(name)
            is_set = value is not None and (value != "" or not (op or "").startswith(":"))
            if op and op.endswith(("-", "=")) and not is_set:
                expanded = self.expand(f'"{word}"' if quoted else word)
                missing += expanded.missing
                value = " ".join(expanded.fields)
                if op.endswith("="):
                    self.assign(name, expanded)
                return _escape(value, quoted), end + 1
            if op and op.endswith("+"):
                if not is_set:
                    return "", end + 1
                expanded = self.expand(f'"{word}"' if quoted else word)
                return _escape(" ".join(expanded.fields), quoted), end + 1
            if value is None:
                missing.append(f"${name}")
                return _escape(f"${{{name}}}", quoted), end + 1
            return _escape(value, quoted), end + 1
        match = NAME.match(raw, i + 1)
        if not match:
            special = raw[i : i + 2]
            if special[1:] in "0123456789@*#":
                missing.append(f"{special} (the script's arguments)")
            elif special[1:] in "$?!-":
                unsupported.append(special)
            else:
                return "$", i + 1
            return _escape(special, quoted), i + 2
        name = match.group(0)
        self._referenced(name)
        missing += self.unknown.get(name, [])
        if name not in self.variables:
            missing.append(f"${name}")
            return _escape(f"${name}", quoted), match.end()
        return _escape(self.variables[name], quoted), match.end()


def _escape(value: str, quoted: bool) -> str:
    """`value` as shlex must see it to yield it literally: in "..." or, unquoted, split only on blanks."""
    if quoted:
        return re.sub(r'(["\\])', r"\\\1", value)
    return re.sub(r"([^\sA-Za-z0-9_./:,=+@%^-])", r"\\\1", value)
