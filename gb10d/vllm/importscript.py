"""Turn a hand-written `vllm serve` start script into gb10d.toml data.

People start vLLM on GB10 with a few lines of shell: variables, `source
venv/bin/activate`, `nohup vllm serve "$MODEL" --flag value ... > log 2>&1 &`.
This module reads such a script the way the shell would for the parts that
matter (variables with `${X:-default}`, quoting, backslash continuations,
assignments before the command, exports) and says what it could not
reproduce, so that nothing is lost silently. It never runs anything.

Words are scanned here (quote-aware, keeping the quotes) because expansion
depends on them; `shlex` then unquotes and splits each expanded word.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import tomli_w

from ..base.command import CHILD_DEFAULTS, CONTAINER_CACHE_ENV, DRAIN_MARGIN_S
from ..base.flags import normalize_flag
from ..base.errors import ConfigError, ConfigProblem

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
_OPERATOR_CHARS = ";&|<>\n"
_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d+)?")

# Prefixes of variables vLLM, PyTorch, CUDA or Hugging Face read; exported ones go to [vllm.env].
_RELEVANT_ENV = (
    "VLLM_", "CUDA_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRITON_", "NCCL_",
    "NVIDIA_", "OMP_", "MKL_", "TOKENIZERS_", "SAFETENSORS_", "UCX_", "GLOO_", "TP_SOCKET_", "RAY_",
    "MASTER_", "FLASHINFER_", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "TMPDIR", "PYTHON",
)
# Commands with no effect on vLLM once gb10d runs it (it owns output, restarts and the process).
_HARMLESS = {
    "echo", "printf", "set", "shopt", "sleep", "mkdir", "touch", "date", "tail", "cat", "tee", "true", ":",
    "umask", "disown", "wait", "exit", "deactivate", "nvidia-smi", "sync", "trap", "rm", "ls", "pwd", *("[", "[[", "test"),
}
_STOPPERS = {"pkill", "kill", "killall"}
_CONTROL = {"if", "then", "elif", "else", "fi", "for", "while", "until", "do", "done", "case", "esac", "function", "{", "}", "(", ")"}
# Compound commands: the word that opens one, and the word that closes it.
_OPENERS = {"if": "fi", "for": "done", "while": "done", "until": "done", "case": "esac", "{": "}"}
# Words that start a command inside a compound one (`then rm x` runs `rm x`).
_INNER_KEYWORDS = {"then", "elif", "else", "do", "if", "while", "until", "!"}
_TESTS = {"[", "[[", "test"}
# Wrappers before the program that gb10d makes unnecessary: systemd keeps it running and owns the process.
_WRAPPERS = {"nohup", "exec", "setsid", "time", "env"}
_SHORT_FLAGS = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-dp": "data-parallel-size", "-q": "quantization"}
_OLD_ENTRY = "vllm.entrypoints.openai.api_server"
_CLI_ENTRY = "vllm.entrypoints.cli.main"
_SYSTEM_PREFIXES = ("/usr", "/usr/local", "/")


@dataclass
class _Command:
    """One simple command as written: raw words with their quotes, and how it was ended."""

    line: int
    words: list[str] = field(default_factory=list)
    redirects: list[str] = field(default_factory=list)
    background: bool = False
    piped_from: bool = False


def _read_word(text: str, i: int) -> int:
    """The index just past the raw word starting at `i` (quotes, `${}`, `$()` and escapes kept whole)."""
    n = len(text)
    while i < n:
        c = text[i]
        if c in " \t" or c in _OPERATOR_CHARS:
            return i
        if c == "\\":
            if text.startswith("\\\n", i):
                return i
            i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            i = n if end < 0 else end + 1
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif text.startswith("$(", i) or text.startswith("${", i):
            open_char = text[i + 1]
            end = _matching(text, i + 1, open_char, ")" if open_char == "(" else "}")
            i = n if end < 0 else end + 1
        elif c == "`":
            end = text.find("`", i + 1)
            i = n if end < 0 else end + 1
        else:
            i += 1
    return i


def _commands(text: str) -> list[_Command]:
    """Split a script into simple commands, handling continuations, comments and operators."""
    commands: list[_Command] = []
    line = 1
    current = _Command(line)
    piped = False
    i, n = 0, len(text)
    word_end = -1

    def finish(background: bool = False, pipe_next: bool = False) -> None:
        nonlocal current, piped
        if current.words or current.redirects:
            current.background = background
            current.piped_from = piped
            commands.append(current)
        piped = pipe_next
        current = _Command(line)

    while i < n:
        c = text[i]
        if text.startswith("\\\n", i):
            i += 2
            line += 1
        elif c in " \t":
            i += 1
        elif c == "\n":
            finish()
            i += 1
            line += 1
            current.line = line
        elif c == "#" and i != word_end:
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c == ";":
            finish()
            i += 1
        elif c == "&" and not text.startswith("&>", i):
            if text.startswith("&&", i):
                finish()
                i += 2
            else:
                finish(background=True)
                i += 1
        elif c == "|":
            if text.startswith("||", i):
                finish()
                i += 2
            else:
                finish(pipe_next=True)
                i += 1
        elif c in "<>&":
            fd = current.words.pop() if current.words and word_end == i and current.words[-1].isdigit() else ""
            start = i
            while i < n and text[i] in "<>&|":
                i += 1
            op = fd + text[start:i]
            if op.endswith("&") and i < n and (text[i].isdigit() or text[i] == "-"):
                target_end = i + 1
            else:
                while i < n and text[i] in " \t":
                    i += 1
                target_end = _read_word(text, i)
            current.redirects.append(op + ("" if op.endswith("&") else " ") + text[i:target_end])
            line += text.count("\n", i, target_end)
            i = target_end
        else:
            end = _read_word(text, i)
            current.words.append(text[i:end])
            line += text.count("\n", i, end)
            i = word_end = end
    finish()
    return commands


@dataclass
class _Block:
    """A compound command (`if ... fi`, a loop, `case`, `{ }`): its lines, its text, and the simple commands in it.

    The script is read as if every command ran once, so a block is judged as
    one thing: harmless, holding the vLLM command, or something gb10d does
    not reproduce; one note or warning each, not one per keyword.
    """

    first: int
    last: int
    text: str
    commands: list[_Command] = field(default_factory=list)


def _blocks(commands: list[_Command]) -> list[_Command | _Block]:
    """Group the simple commands into top-level commands and compound blocks, stripping the keywords inside."""
    items: list[_Command | _Block] = []
    block: _Block | None = None
    closers: list[str] = []
    for command in commands:
        words = command.words
        opener = words[0] if words else ""
        if block is None and opener not in _OPENERS:
            items.append(command)
            continue
        if block is None:
            block = _Block(command.line, command.line, "")
            items.append(block)
        block.last = command.line
        joiner = " " if block.text.endswith((" then", " do", " else", " {")) or block.text in ("{",) else "; "
        block.text += (joiner if block.text else "") + " ".join(words + command.redirects)
        inner = list(words)
        while inner and (inner[0] in _OPENERS or inner[0] in _INNER_KEYWORDS or (closers and inner[0] == closers[-1])):
            word = inner.pop(0)
            if word in _OPENERS:
                closers.append(_OPENERS[word])
                if word in ("for", "case"):
                    inner = []  # `for x in ...` and `case $x in` are headers, not commands
            elif closers and word == closers[-1]:
                closers.pop()
        if inner:
            block.commands.append(_Command(command.line, inner, command.redirects, command.background, command.piped_from))
        if not closers:
            block = None
    return items


@dataclass(frozen=True)
class ScriptOwner:
    """Whose script it is: `~` and `$HOME` in it mean this home, `~user` the home `lookup` gives."""

    name: str
    home: str
    lookup: Callable[[str], str | None] = lambda _user: None

    def home_of(self, user: str) -> str | None:
        return self.home if user == self.name else self.lookup(user)


@dataclass
class _Expansion:
    """An expanded word: its fields, and what could not be known from the script."""

    fields: list[str]
    missing: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


class _Shell:
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

    def assign(self, name: str, expanded: _Expansion) -> None:
        """Set a variable to an expanded value, remembering what in it could not be known."""
        self.variables[name] = " ".join(expanded.fields)
        self.unknown[name] = expanded.missing + expanded.unsupported

    def expand(self, raw: str) -> _Expansion:
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
                end = raw.find("`", i + 1) if c == "`" else _matching(raw, i + 1, "(", ")")
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
        return _Expansion(fields, missing, unsupported)

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
            end = _matching(raw, i + 1, "{", "}")
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
        match = _NAME.match(raw, i + 1)
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


def _matching(text: str, start: int, open_char: str, close_char: str) -> int:
    """Index of the bracket closing the one at `start`, or -1."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == open_char:
            depth += 1
        elif text[index] == close_char:
            depth -= 1
            if depth == 0:
                return index
    return -1


def _escape(value: str, quoted: bool) -> str:
    """`value` as shlex must see it to yield it literally: in "..." or, unquoted, split only on blanks."""
    if quoted:
        return re.sub(r'(["\\])', r"\\\1", value)
    return re.sub(r"([^\sA-Za-z0-9_./:,=+@%^-])", r"\\\1", value)


def _value(text: str) -> Any:
    """A flag value in the TOML type that prints back the same: 131072 -> int, 0.5 -> float, JSON -> table."""
    if re.fullmatch(r"-?\d+", text) and str(int(text)) == text:
        return int(text)
    if re.fullmatch(r"-?\d+\.\d+", text) and repr(float(text)) == text:
        return float(text)
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return text
        if isinstance(parsed, dict) and not _has_null(parsed):
            return parsed
    return text


def _has_null(value: Any) -> bool:
    """TOML has no null, so JSON holding one must stay a string."""
    if isinstance(value, dict):
        return any(_has_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_null(v) for v in value)
    return value is None


def _is_vllm(word: str) -> bool:
    return posixpath.basename(word) == "vllm"


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", posixpath.basename(word)) is not None


@dataclass
class _Import:
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


def _interpret(shell: _Shell, command: _Command, result: _Import) -> None:
    """Apply one command of the script: variables, venv activation, the vllm command, or a warning."""
    line = command.line
    assignments: list[tuple[str, _Expansion]] = []
    index = 0
    while index < len(command.words) and (match := _ASSIGNMENT.fullmatch(command.words[index])):
        assignments.append((match.group(1), shell.expand(match.group(2))))
        index += 1
    words = command.words[index:]
    if not words:
        for name, expanded in assignments:
            shell.assign(name, expanded)
            if _relevant(name) and name not in shell.exported:
                result.warnings.append(
                    f"line {line}: {name} is set but not exported, so vLLM does not see it; "
                    "add it to [vllm.env] if it should"
                )
        return
    head = shell.expand(words[0])
    program = head.fields[0] if head.fields else ""
    if program in ("export", "declare", "readonly", "local", "typeset"):
        _declare(shell, program, words[1:], line, result)
        return
    expansions = [shell.expand(w) for w in words]
    fields = [f for e in expansions for f in e.fields]
    if program in ("source", "."):
        for expanded in expansions:
            _warn_unknowns(result, line, expanded)
        _source(fields[1:], line, result)
        return
    if program == "cd":
        target = fields[1] if len(fields) > 1 else ""
        result.cwd = result.absolute(target, line, "cd") if target.startswith("/") or result.cwd else None
        if result.cwd is None:
            result.warnings.append(f"line {line}: cd {target!r} cannot be followed; relative paths after it are not resolved")
        return
    engine_at = next((k for k, f in enumerate(fields) if posixpath.basename(f) in _ENGINES and fields[k + 1 : k + 2] == ["run"]), None)
    if engine_at is not None:
        if "sudo" in fields[:engine_at]:
            result.notes.append(f"line {line}: sudo not needed: the gb10d user is allowed on the engine's socket instead (see the README, \"vLLM in a container\")")
        _wrappers([w for w in fields[:engine_at] if w != "sudo"], line, result)
        _container_command(shell, fields[engine_at:], command, result)
        return
    start = _vllm_start(fields)
    if start is not None:
        _wrappers(fields[:start], line, result)
        if result.found == 0:
            for expanded in [*expansions, *(e for _, e in assignments)]:
                _warn_unknowns(result, line, expanded)
        _vllm_command(shell, fields[start:], [(n, " ".join(e.fields)) for n, e in assignments], command, result)
        return
    _other(fields, command, result)


def _vllm_start(fields: list[str]) -> int | None:
    """The index of the vllm (or python -m vllm...) word when this command runs vLLM, else None."""
    start = next((k for k, f in enumerate(fields) if _is_vllm(f) or _is_python(f)), None)
    runs_vllm = start is not None and (
        fields[start + 1 : start + 2] == ["-m"] or (_is_vllm(fields[start]) and (start == 0 or fields[start + 1 : start + 2] == ["serve"]))
    )
    # `pkill -f vllm` or `echo vllm serve` mention vllm without running it.
    return start if runs_vllm and posixpath.basename(fields[0]) not in _HARMLESS | _STOPPERS else None


def _relevant(name: str) -> bool:
    return name.startswith(_RELEVANT_ENV)


def _warn_unknowns(result: _Import, line: int, expanded: _Expansion) -> None:
    for name in expanded.missing:
        result.warnings.append(f"line {line}: {name} is not set in the script; the value was kept as written, replace it")
    for text in expanded.unsupported:
        result.warnings.append(f"line {line}: {text} cannot be evaluated without running it; the text was kept as written, replace it")


def _declare(shell: _Shell, program: str, words: list[str], line: int, result: _Import) -> None:
    """`export X=1 Y` and friends: set variables, and remember which ones the child would inherit."""
    exporting = program == "export"
    for word in words:
        if word.startswith("-"):
            exporting = exporting or "x" in word
            continue
        match = _ASSIGNMENT.fullmatch(word)
        if match:
            name = match.group(1)
            shell.assign(name, shell.expand(match.group(2)))
        elif _NAME.fullmatch(word):
            name = word
        else:
            result.warnings.append(f"line {line}: {program} {word!r} is not understood")
            continue
        if exporting:
            shell.exported.add(name)


def _source(fields: list[str], line: int, result: _Import) -> None:
    """`source VENV/bin/activate` names the venv; other sourced files cannot be followed."""
    target = fields[0] if fields else ""
    if posixpath.basename(target) == "activate" and posixpath.basename(posixpath.dirname(target)) == "bin":
        result.venv = result.absolute(posixpath.dirname(posixpath.dirname(target)), line, "venv")
        return
    result.warnings.append(
        f"line {line}: source {target!r} was not read; if it sets variables vLLM needs, add them to [vllm.env]"
    )


def _wrappers(prefix: list[str], line: int, result: _Import) -> None:
    """Words before the program: nohup/exec/env are not needed under systemd, others are not reproduced."""
    if not prefix:
        return
    known = [w for w in prefix if w in _WRAPPERS]
    unknown = [w for w in prefix if w not in _WRAPPERS]
    if known:
        result.notes.append(
            f"line {line}: {' '.join(known)} not needed: systemd keeps gb10d running and gb10d owns the vLLM process"
        )
    if unknown:
        result.warnings.append(
            f"line {line}: {shlex.join(unknown)!r} before vllm is not reproduced; gb10d runs vLLM directly "
            "(CPU pinning or priorities belong in a systemd drop-in: systemctl edit gb10d)"
        )


def _program(fields: list[str], line: int, result: _Import) -> list[str]:
    """Set venv or executable from the program word; return the words after `serve` (or the entry point)."""
    word = fields[0]
    if _is_vllm(word):
        rest = fields[1:]
        if rest[:1] != ["serve"]:
            result.warnings.append(f"line {line}: vllm {' '.join(rest[:1])!r} is not 'vllm serve'; read as if it were")
        else:
            rest = rest[1:]
        if "/" in word:
            path = result.absolute(word, line, "vllm")
            if result.venv is not None and path == posixpath.join(result.venv, "bin", "vllm"):
                return rest
            result.vllm["executable"] = path
            result.venv = None
        elif result.venv is None and "image" not in result.vllm:
            result.warnings.append(
                "the script runs 'vllm' from PATH; set vllm.executable to its full path (see: command -v vllm) or vllm.venv"
            )
        return rest
    module = fields[2] if len(fields) > 2 else ""
    rest = fields[3:]
    old = module == _OLD_ENTRY
    if module == _CLI_ENTRY and rest[:1] == ["serve"]:
        rest = rest[1:]
    elif not old:
        result.warnings.append(f"line {line}: python -m {module} is not a vLLM server entry point; read as if it were")
    if old:
        result.notes.append(
            f"line {line}: python -m {_OLD_ENTRY} is vLLM's old entry point; gb10d runs 'vllm serve', which takes the same flags"
        )
    if "/" in word:
        bindir = posixpath.dirname(result.absolute(word, line, "python"))
        root = posixpath.dirname(bindir)
        if posixpath.basename(bindir) == "bin" and root not in _SYSTEM_PREFIXES:
            result.venv = root
        elif result.venv is None:
            result.vllm["executable"] = "/usr/local/bin/vllm"
            result.warnings.append(
                f"line {line}: vLLM runs from the system Python {word}; executable was guessed as /usr/local/bin/vllm, check it"
            )
    elif result.venv is None:
        result.warnings.append("the script runs 'python' from PATH; set vllm.venv to the virtualenv that has vLLM")
    return rest


def _vllm_command(shell: _Shell, fields: list[str], assignments: list[tuple[str, str]], command: _Command, result: _Import) -> None:
    """The vllm serve command itself: program, model, flags, environment, and what wraps it."""
    line = command.line
    result.found += 1
    if result.found > 1:
        result.warnings.append(f"line {line}: another vLLM command; gb10d runs one vLLM per config, so only the first was imported")
        return
    rest = _program(fields, line, result)
    positional, flags = _split_flags(rest, line, result)
    if positional:
        result.vllm["model"] = positional[0]
        if positional[0].startswith(("./", "../", "~")):
            result.vllm["model"] = result.absolute(positional[0], line, "model")
        if len(positional) > 1:
            result.warnings.append(f"line {line}: extra words {shlex.join(positional[1:])!r} after the model; kept in extra_args")
            result.extra_args += positional[1:]
    for flag, values, spelled in flags:
        _flag(flag, values, spelled, line, result)
    if "model" not in result.vllm:
        result.warnings.append(f"line {line}: no model was given; set vllm.model")
    _environment(shell, assignments, line, result)
    if command.redirects:
        outputs = [r.split(None, 1)[1] for r in command.redirects if r.split(None, 1)[0] in (">", ">>", "1>", "1>>", "&>", "&>>") and " " in r]
        target = " ".join(shell.expand(outputs[0]).fields) if outputs else ""
        result.notes.append(
            f"line {line}: {' '.join(command.redirects)} not needed: vLLM's output goes to the journal now "
            f"(journalctl -u gb10d){f', no longer to {target}' if target else ''}"
        )
    if command.background:
        result.notes.append(
            f"line {line}: & not needed: systemd runs gb10d in the background, and systemctl start gb10d returns once vLLM serves"
        )
    if command.piped_from:
        result.warnings.append(f"line {line}: vllm reads from a pipe here; gb10d gives it no input")


def _split_flags(words: list[str], line: int, result: _Import) -> tuple[list[str], list[tuple[str, list[str], str]]]:
    """Positional words and (flag, values, as written) in order; a flag takes every value up to the next flag."""
    positional: list[str] = []
    flags: list[tuple[str, list[str], str]] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.fullmatch(word):
            name, eq, value = word.partition("=")
            if not name.startswith("--"):
                if name not in _SHORT_FLAGS:
                    result.warnings.append(f"line {line}: short option {word!r} is not known; kept in extra_args")
                    result.extra_args.append(word)
                    continue
                name = "--" + _SHORT_FLAGS[name]
            values = [value] if eq else []
            while not eq and index < len(words) and (not words[index].startswith("-") or _NEGATIVE_NUMBER.fullmatch(words[index])):
                values.append(words[index])
                index += 1
            flags.append((normalize_flag(name), values, word))
        else:
            positional.append(word)
    return positional, flags


def _flag(flag: str, values: list[str], spelled: str, line: int, result: _Import) -> None:
    """Place one flag where gb10d.toml keeps it: a first-class [vllm] key or [vllm.args]."""
    first_class = {"host": "host", "port": "port", "served-model-name": "served_model_name",
                   "gpu-memory-utilization": "gpu_memory_utilization", "model": "model"}
    key = first_class.get(flag)
    if key in result.vllm or flag in result.args or (flag.startswith("no-") and flag[3:] in result.args):
        result.warnings.append(f"line {line}: --{flag} is given twice; the last value is used, as vLLM does")
    if key == "served_model_name" and values:
        result.vllm[key] = values[0] if len(values) == 1 else values
    elif key is not None:
        if len(values) != 1:
            result.warnings.append(f"line {line}: --{flag} needs one value (got {shlex.join(values) or 'none'}); set vllm.{key} yourself")
            return
        converted: Any = values[0]
        try:
            converted = {"port": int, "gpu_memory_utilization": float}.get(key, str)(values[0])
        except ValueError:
            result.warnings.append(f"line {line}: --{flag} {values[0]!r} is not a number; set vllm.{key} yourself")
            return
        result.vllm[key] = converted
    elif not re.fullmatch(r"[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_-]+)*", flag):
        result.warnings.append(f"line {line}: {spelled!r} is not a flag name gb10d can write as a key; kept in extra_args")
        result.extra_args += [spelled, *values] if "=" not in spelled else [spelled]
    elif not values:
        if flag.startswith("no-"):
            result.args[flag[3:]] = False
        else:
            result.args[flag] = True
    else:
        result.args[flag] = _value(values[0]) if len(values) == 1 else [_value(v) for v in values]
    if flag in ("api-key", "hf-token"):
        result.warnings.append(
            f"line {line}: --{flag} is a secret and gb10d.toml is usually world-readable; better put "
            f"{'VLLM_API_KEY' if flag == 'api-key' else 'HF_TOKEN'}=... in a file only root and gb10d can read "
            f"(chmod 0640), set vllm.env_file to it, and remove {flag} from [vllm.args]"
        )


def _environment(shell: _Shell, assignments: list[tuple[str, str]], line: int, result: _Import) -> None:
    """What vLLM would inherit from the script: exports and assignments before the command."""
    inherited = {name: shell.variables.get(name, "") for name in sorted(shell.exported)}
    for name, value in [*inherited.items(), *assignments]:
        if name == "PATH":
            result.notes.append(f"line {line}: PATH is not copied; gb10d puts the venv's bin first on its own PATH")
            continue
        if name == "VIRTUAL_ENV":
            result.venv = result.venv or value
            continue
        if name in dict(assignments) or _relevant(name) or name not in shell.referenced:
            if not _relevant(name) and name not in dict(assignments):
                result.warnings.append(f"line {line}: exported {name} is passed to vLLM; remove it from [vllm.env] if vLLM does not need it")
            result.env[name] = value
        else:
            result.notes.append(f"exported {name} is used only by the script itself; not passed to vLLM")
    for name in result.env:
        if re.search(r"TOKEN|KEY|SECRET|PASSWORD", name, re.IGNORECASE):
            result.warnings.append(
                f"{name} is a secret and gb10d.toml is usually world-readable; better move it to a file only root and "
                f"gb10d can read (chmod 0640, lines like {name}=...), set vllm.env_file to it, and remove it from [vllm.env]"
            )


def _other(fields: list[str], command: _Command, result: _Import) -> None:
    """A command that is not the vllm one: ignored with a note when harmless, else a warning."""
    name = posixpath.basename(fields[0]) if fields else ""
    text = shlex.join(fields)
    if "drop_caches" in text:
        result.notes.append(f"line {command.line}: page-cache dropping is done by gb10d itself ([memory] evict_page_cache)")
    elif name in _HARMLESS:
        result.ignored.append(f"{name} (line {command.line})")
    elif name in _STOPPERS:
        result.notes.append(f"line {command.line}: {name} not needed: gb10d stops the previous vLLM itself")
    elif name == "ulimit":
        result.warnings.append(
            f"line {command.line}: {text!r} is not reproduced; set LimitNOFILE= or LimitMEMLOCK= with systemctl edit gb10d"
        )
    elif name in _CONTROL:
        result.warnings.append(
            f"line {command.line}: shell control flow ({name}) is not understood; every line was read as if it ran, check the result"
        )
    else:
        result.warnings.append(f"line {command.line}: {text!r} is not understood and was not imported; if vLLM depends on it, do it another way (e.g. ExecStartPre= in a systemd drop-in)")


def _block(shell: _Shell, block: _Block, result: _Import) -> None:
    """A compound command as one thing: its variables are applied, and it gets one note or one warning."""
    lines = f"line {block.first}" if block.first == block.last else f"lines {block.first}-{block.last}"
    shown = block.text if len(block.text) <= 100 else block.text[:97] + "..."
    others: list[str] = []
    runs_vllm = False
    for command in block.commands:
        fields = [f for w in command.words for f in shell.expand(w).fields]
        name = posixpath.basename(fields[0]) if fields else ""
        if not fields or _ASSIGNMENT.fullmatch(command.words[0]) or name in ("export", "declare", "readonly", "local", "typeset", "source", ".", "cd"):
            _interpret(shell, command, result)
        elif _vllm_start(fields) is not None:
            runs_vllm = True
            _interpret(shell, command, result)
        elif name not in _HARMLESS | _STOPPERS:
            others.append(name)
    if runs_vllm:
        result.warnings.append(f"{lines}: the vLLM command is inside `{shown}`; gb10d runs it every time, as if the condition held; check the result")
    elif others:
        result.warnings.append(
            f"{lines}: `{shown}` is not reproduced ({', '.join(dict.fromkeys(others))}); if vLLM depends on it, "
            "do it another way (e.g. ExecStartPre= in a systemd drop-in: systemctl edit gb10d)"
        )
    else:
        result.notes.append(f"{lines}: `{shown}` has no effect on vLLM under gb10d; ignored")


# --- vLLM from a container image: `docker run [options] IMAGE vllm serve MODEL flags` -------------------

_ENGINES = ("docker", "podman")
# `docker run` options that take a value (as `-e X=1` or `--env=X=1`); any other option is a switch.
_VALUED_OPTIONS = {
    "-a", "--attach", "-c", "--cpu-shares", "-e", "--env", "--env-file", "-h", "--hostname", "-l", "--label", "--label-file",
    "-m", "--memory", "-p", "--publish", "-u", "--user", "-v", "--volume", "-w", "--workdir", "--add-host", "--cap-add",
    "--cap-drop", "--cgroupns", "--cidfile", "--cpus", "--cpuset-cpus", "--device", "--dns", "--entrypoint", "--gpus",
    "--group-add", "--ipc", "--log-driver", "--log-opt", "--memory-swap", "--mount", "--name", "--network", "--net",
    "--pid", "--platform", "--pull", "--restart", "--runtime", "--security-opt", "--shm-size", "--stop-signal",
    "--stop-timeout", "--tmpfs", "--ulimit", "--userns", "--uts", "--health-cmd", "--pids-limit",
}
_SHORT_SWITCHES = set("itdP")
# What a gb10d-made line carries for gb10d's own bookkeeping; reading it back changes nothing.
_OWN_LABEL = "gb10d.config="


def _engine_options(words: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(option, value) pairs up to the image, and the words from the image on; `-it` is `-i`, `-t`."""
    options: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "-":
        word = words[index]
        index += 1
        name, eq, value = word.partition("=")
        if not name.startswith("--") and len(name) > 2 and set(name[1:]) <= _SHORT_SWITCHES:
            options += [(f"-{c}", None) for c in name[1:]]
        elif not name.startswith("--") and len(name) > 2 and name[:2] in _VALUED_OPTIONS:
            options.append((name[:2], word[2:]))  # -p8000:8000
        elif name in _VALUED_OPTIONS and not eq:
            options.append((name, words[index] if index < len(words) else ""))
            index += 1
        else:
            options.append((name, value if eq else None))
    return options, words[index:]


def _container_command(shell: _Shell, fields: list[str], command: _Command, result: _Import) -> None:
    """`docker run ... IMAGE [vllm serve] MODEL flags`: [vllm] image and [container], then the vllm command as usual."""
    line = command.line
    engine = posixpath.basename(fields[0])
    options, rest = _engine_options(fields[2:])
    if not rest:
        result.warnings.append(f"line {line}: {engine} run names no image; set vllm.image")
        return
    image, rest = rest[0], rest[1:]
    result.vllm["image"] = image
    if engine == "podman":
        result.container["engine"] = "podman"
    published: list[str] = []
    for option, value in options:
        _engine_option(shell, engine, option, value or "", line, result, published)
    if rest[:2] == ["vllm", "serve"] or (rest[:1] and (_is_vllm(rest[0]) or _is_python(rest[0]))):
        _vllm_command(_Shell(), rest, [], command, result)
    else:
        result.notes.append(f"line {line}: no command after the image: its entrypoint is taken to run `vllm serve` with the words that follow")
        _vllm_command(_Shell(), ["vllm", "serve", *rest], [], command, result)
    port = str(result.vllm.get("port", 8000))
    for mapping in published:
        host, _, inside = mapping.rpartition(":")
        host = host.rpartition(":")[2]  # 127.0.0.1:8000:8000
        if inside.split("/")[0] == port and host.isdigit() and host != port:
            result.vllm["port"] = int(host)
            result.notes.append(f"line {line}: -p {mapping}: the container uses the host's network under gb10d, so vLLM listens on {host} itself")
        else:
            result.notes.append(f"line {line}: -p {mapping} not needed: the container uses the host's network, so vllm.port is the host's port")


def _engine_option(shell: _Shell, engine: str, option: str, value: str, line: int, result: _Import, published: list[str]) -> None:
    """One `docker run` option: a [container] key, an environment variable, a note that gb10d does it, or run_args."""
    c = result.container
    gb10d_does = {
        "--name": "gb10d names the container after its config (container.name)",
        "--rm": "gb10d removes the container itself once it has read how it ended",
        "-i": "vLLM reads no input", "--interactive": "vLLM reads no input", "-t": "gb10d reads vLLM's output through pipes",
        "--tty": "gb10d reads vLLM's output through pipes", "-d": "systemd keeps gb10d running and gb10d stays attached",
        "--detach": "systemd keeps gb10d running and gb10d stays attached", "--restart": "gb10d restarts vLLM with corrected settings, and systemd restarts gb10d",
        "--init": "gb10d adds --init (container.init)", "--log-driver": "gb10d sends vLLM's output to the journal",
        "--stop-timeout": "gb10d stops the container after [daemon] stop_timeout_s", "--network": "gb10d uses the host's network",
        "--net": "gb10d uses the host's network",
    }
    if option in gb10d_does:
        result.notes.append(f"line {line}: {option} not needed: {gb10d_does[option]}")
    elif option in ("-e", "--env"):
        name, eq, text = value.partition("=")
        if name in CHILD_DEFAULTS or name in CONTAINER_CACHE_ENV:
            return  # gb10d sets these itself
        if not eq:
            text = shell.variables.get(name, f"${name}")
            if name not in shell.variables:
                result.warnings.append(f"line {line}: -e {name} passes the script's {name}, which it does not set; put {name}=... in vllm.env_file")
        result.env[name] = text
    elif option == "--env-file":
        result.vllm["env_file"] = result.absolute(value, line, "--env-file")
    elif option in ("-v", "--volume"):
        _mount(value, line, result)
    elif option in ("-p", "--publish"):
        published.append(value)
    elif option == "--gpus" or (option == "--runtime" and value == "nvidia"):
        if value.strip("\"'") not in ("all", "nvidia"):
            result.warnings.append(f"line {line}: {option} {value}: gb10d gives the container all GPUs (a GB10 has one); set container.gpu to change how")
    elif option == "--device" and value.startswith("nvidia.com/gpu"):
        if engine == "docker":
            c["gpu"] = "cdi"
    elif option == "--ipc":
        if value != "host":
            result.warnings.append(f"line {line}: --ipc {value}: gb10d uses --ipc=host, or a private /dev/shm of container.shm_size")
    elif option == "--shm-size":
        c["shm_size"] = value
    elif option == "--pull":
        if value in ("missing", "always"):
            c["pull"] = value
        else:
            result.notes.append(f"line {line}: --pull {value}: gb10d pulls before it runs, as container.pull says (\"missing\" by default)")
    elif option in ("-l", "--label") and value.startswith(_OWN_LABEL):
        return
    else:
        if option not in ("--ulimit", "--user", "-u", "--cap-add", "--security-opt", "--device", "--tmpfs", "--privileged", "--runtime"):
            result.warnings.append(f"line {line}: {option} is not a setting gb10d knows; kept in container.run_args, check it")
        c.setdefault("run_args", []).extend([option] if value == "" and option not in _VALUED_OPTIONS else [f"{option}={value}"])


def _mount(value: str, line: int, result: _Import) -> None:
    """`-v HOST:CONTAINER[:OPTIONS]`: a mount, except over gb10d's own cache directory or the local model's."""
    host, _, inside = value.partition(":")
    inside_path = inside.partition(":")[0]
    if inside_path == "/root/.cache" or inside_path.startswith("/root/.cache/"):
        if host in ("/var/cache/gb10d", ""):
            return
        if not host.startswith("/"):
            result.warnings.append(
                f"line {line}: -v {value}: the script's cache is not mounted; gb10d keeps the Hugging Face and compile caches in "
                f"/var/cache/gb10d (mounted at /root/.cache): move the downloaded models there, or mount the cache by its absolute path in container.mounts"
            )
            return
    if inside_path == result.vllm.get("model") and inside_path == host:
        return  # gb10d mounts a local model directory itself
    if not host.startswith("/"):
        result.warnings.append(f"line {line}: -v {value}: {host!r} is not an absolute path (a named volume, ~ or a relative path); write the host's absolute path in container.mounts")
    result.container.setdefault("mounts", []).append(value)


# --- docker compose files ----------------------------------------------------------------------------

_COMPOSE_RUN_OPTIONS = {
    "container_name": "--name", "ipc": "--ipc", "shm_size": "--shm-size", "network_mode": "--network", "restart": "--restart",
    "runtime": "--runtime", "user": "--user", "pull_policy": "--pull",
}
_COMPOSE_LISTS = {"environment": "-e", "volumes": "-v", "ports": "-p", "env_file": "--env-file", "devices": "--device"}


def looks_like_compose(text: str) -> bool:
    """A docker compose file: YAML with a top-level `services:` mapping."""
    return re.search(r"^services:\s*(#.*)?$", text, re.MULTILINE) is not None


def _yaml_scalar(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [_yaml_scalar(item) for item in text[1:-1].split(",") if item.strip()]
    if text.startswith("{") and text.endswith("}"):
        return {k.strip(): _yaml_scalar(v) for k, _, v in (item.partition(":") for item in text[1:-1].split(",")) if k.strip()}
    return text


def _yaml_lines(text: str) -> list[tuple[int, str]]:
    """(indent, content) of the lines that carry something, comments removed."""
    lines = []
    for raw in text.splitlines():
        content = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if content.strip() and content.strip() != "---":
            lines.append((len(content) - len(content.lstrip()), content.strip()))
    return lines


def _yaml_block(lines: list[tuple[int, str]], start: int, indent: int) -> tuple[Any, int]:
    """The mapping or list whose lines start at `start` with this indentation (the subset compose files use)."""
    if start < len(lines) and lines[start][1].startswith("- "):
        items: list[Any] = []
        index = start
        while index < len(lines) and lines[index][0] == indent and lines[index][1].startswith("- "):
            body = lines[index][1][2:]
            if re.match(r"^[\w.-]+:(\s|$)", body):
                # `- driver: nvidia` opens a mapping whose further keys sit under the first one.
                nested = [(indent + 2, body)] + [(i, c) for i, c in lines[index + 1 :]]
                value, used = _yaml_block(nested, 0, indent + 2)
                items.append(value)
                index += used
            else:
                items.append(_yaml_scalar(body))
                index += 1
        return items, index - start
    mapping: dict[str, Any] = {}
    index = start
    while index < len(lines) and lines[index][0] == indent:
        key, _, rest = lines[index][1].partition(":")
        index += 1
        rest = rest.strip()
        if rest in ("|", ">", "|-", ">-"):
            block = []
            while index < len(lines) and lines[index][0] > indent:
                block.append(lines[index][1])
                index += 1
            mapping[key.strip()] = " ".join(block)
        elif rest:
            mapping[key.strip()] = _yaml_scalar(rest)
        elif index < len(lines) and lines[index][0] > indent:
            mapping[key.strip()], used = _yaml_block(lines, index, lines[index][0])
            index += used
        else:
            mapping[key.strip()] = None
    return mapping, index - start


def _compose_run(service: dict[str, Any], warnings: list[str]) -> list[str]:
    """The `docker run` words equivalent to one compose service, as far as gb10d has settings for them."""
    words = ["docker", "run"]
    for key, value in service.items():
        if key in _COMPOSE_RUN_OPTIONS:
            words += [_COMPOSE_RUN_OPTIONS[key], str(value)]
        elif key in _COMPOSE_LISTS:
            entries = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else value if isinstance(value, list) else [value]
            for entry in entries:
                if isinstance(entry, dict):
                    warnings.append(f"{key}: the long form {entry} is not read; write it as a short HOST:CONTAINER[:OPTIONS] entry")
                else:
                    words += [_COMPOSE_LISTS[key], str(entry)]
        elif key == "init" and str(value) == "true":
            words.append("--init")
        elif key == "ulimits" and isinstance(value, dict):
            for name, limit in value.items():
                bound = f"{limit.get('soft')}:{limit.get('hard')}" if isinstance(limit, dict) else str(limit)
                words += ["--ulimit", f"{name}={bound}"]
        elif key == "deploy" and "nvidia" in str(value) and "gpu" in str(value):
            words += ["--gpus", "all"]
        elif key not in ("image", "command"):
            warnings.append(f"{key}: not read; gb10d has no setting for it")
    image = str(service.get("image", ""))
    command = service.get("command")
    words.append(image)
    if isinstance(command, list):
        words += [str(w) for w in command]
    elif command:
        words += shlex.split(str(command))
    return words


def import_compose(text: str, shown: str) -> Imported:
    """A compose file is not imported as such; the answer is the config equivalent to its vLLM service."""
    services, _ = _yaml_block(_yaml_lines(text), 0, 0)
    found = services.get("services") if isinstance(services, dict) else None
    if not isinstance(found, dict) or not found:
        raise ConfigError([ConfigProblem(shown, "", "a docker compose file without services; nothing to import")])
    name, service = next(((n, s) for n, s in found.items() if "vllm" in str(s)), next(iter(found.items())))
    if not isinstance(service, dict) or not service.get("image"):
        raise ConfigError([ConfigProblem(shown, "", f"the compose service {name!r} names no image; gb10d runs vLLM from an image, a venv or an executable")])
    warnings = [
        f"docker compose files are not supported: gb10d runs, restarts and stops the container itself (a compose restart "
        f"policy would restart it behind gb10d's back). Stop the compose project (docker compose down), then use this "
        f"config, the equivalent of its service {name!r}"
    ]
    words = _compose_run(service, warnings)
    if len(found) > 1:
        warnings.append(f"only the service {name!r} was read; gb10d runs one vLLM per config ({', '.join(n for n in found if n != name)} left out)")
    if "${" in text:
        warnings.append("compose fills ${...} from its .env file or environment; the text was kept as written, replace it (secrets in vllm.env_file)")
    result = _Import()
    _container_command(_Shell(), words, _Command(0, words), result)
    imported = import_script_result(result)
    where = f"service {name}: "
    return Imported(imported.data, [n.replace("line 0: ", where) for n in imported.notes],
                    warnings + [w.replace("line 0: ", where) for w in imported.warnings])


@dataclass(frozen=True)
class Imported:
    """The gb10d.toml tables read from a script, and what the operator must know about them."""

    data: dict[str, Any]
    notes: list[str]
    warnings: list[str]


def import_script(text: str, shown: str = "<script>", owner: ScriptOwner | None = None) -> Imported:
    """Read a start script and return the equivalent gb10d.toml data; ConfigError if it runs no vLLM.

    `owner` is whose script it is: its `~` and `$HOME` become their home, as when they ran it.
    """
    shell = _Shell(owner)
    result = _Import()
    if "\r\n" in text:
        # bash would pass each \r on to vLLM as part of the last word; the intent is plain newlines.
        result.notes.append("the script has Windows line endings (CRLF); read as if it had plain newlines")
    if looks_like_compose(text):
        return import_compose(text, shown)
    for item in _blocks(_commands(text.replace("\r\n", "\n"))):
        if isinstance(item, _Block):
            _block(shell, item, result)
        else:
            _interpret(shell, item, result)
    if not result.found:
        raise ConfigError([ConfigProblem(shown, "", "no vllm serve (or python -m vllm.entrypoints.openai.api_server) command found; nothing to import")])
    if shell.homes_used and owner is not None:
        by_home: dict[str, list[str]] = {}
        for word, home in shell.homes_used.items():
            by_home.setdefault(home, []).append(word)
        said = ", ".join(f"{' and '.join(words)} as {home}" for home, words in by_home.items())
        result.notes.append(f"read {said}, as when {owner.name} runs the script: the service has another home")
    return import_script_result(result)


def import_script_result(result: _Import) -> Imported:
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
    if imported.notes or imported.warnings:
        header.append("#")
    header += [f"# note: {n}" for n in imported.notes]
    header += [f"# warning: {w}" for w in imported.warnings]
    return "\n".join(header) + "\n\n" + tomli_w.dumps(imported.data)


def read_script(path: Path) -> tuple[str, str]:
    """A script's text (stdin for `-`) and the name to show for it; ConfigError when it cannot be read."""
    shown = "<stdin>" if str(path) == "-" else str(path)
    try:
        raw = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except IsADirectoryError:
        raise ConfigError([ConfigProblem(shown, "", "is a directory; pass the start script itself")]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(shown, "", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8"), shown
    except UnicodeDecodeError:
        raise ConfigError([ConfigProblem(shown, "", "not UTF-8 text; is this really a shell script?")]) from None


def import_script_file(path: Path) -> str:
    """Read a script file (or stdin for `-`) and return the gb10d.toml text of what it says; ConfigError when unreadable."""
    text, shown = read_script(path)
    return render(import_script(text, shown), shown)
