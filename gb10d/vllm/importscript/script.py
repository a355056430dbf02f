"""Turn a hand-written `vllm serve` start script into gb10d.toml data.

People start vLLM on GB10 with a few lines of shell: variables, `source
venv/bin/activate`, `nohup vllm serve "$MODEL" --flag value ... > log 2>&1 &`.
This module reads such a script the way the shell would for the parts that
matter (variables with `${X:-default}`, quoting, backslash continuations,
assignments before the command, exports) and says what it could not
reproduce, so that nothing is lost silently. It never runs anything.

It goes through the script command by command (assignments, exports,
`source`, `cd`, the vLLM command, everything else) and judges compound
blocks whole. The shell's syntax (shellsyntax) and variables
(shellexpansion), the vLLM command (servecommand), `docker run`
(dockerrun), compose files (compose) and the TOML written (importtoml)
each have a module of their own.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import sys
from pathlib import Path

from ...base.errors import ConfigError, ConfigProblem
from .compose import import_compose, looks_like_compose
from .dockerrun import ENGINES, container_command
from .importtoml import Findings, Imported, import_script_result
from .servecommand import HARMLESS, STOPPERS, relevant, vllm_command, vllm_start, wrappers
from .shellexpansion import NAME, Expansion, ScriptOwner, Shell
from .shellsyntax import Block, Command, group_blocks, split_commands

_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
_CONTROL = {"if", "then", "elif", "else", "fi", "for", "while", "until", "do", "done", "case", "esac", "function", "{", "}", "(", ")"}


def import_script(text: str, shown: str = "<script>", owner: ScriptOwner | None = None) -> Imported:
    """Read a start script and return the equivalent gb10d.toml data; ConfigError if it runs no vLLM.

    `owner` is whose script it is: its `~` and `$HOME` become their home, as when they ran it.
    """
    shell = Shell(owner)
    result = Findings()
    if "\r\n" in text:
        # bash would pass each \r on to vLLM as part of the last word; the intent is plain newlines.
        result.notes.append("the script has Windows line endings (CRLF); read as if it had plain newlines")
    if looks_like_compose(text):
        return import_compose(text, shown)
    for item in group_blocks(split_commands(text.replace("\r\n", "\n"))):
        if isinstance(item, Block):
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


def _interpret(shell: Shell, command: Command, result: Findings) -> None:
    """Apply one command of the script: variables, venv activation, the vllm command, or a warning."""
    line = command.line
    assignments: list[tuple[str, Expansion]] = []
    index = 0
    while index < len(command.words) and (match := _ASSIGNMENT.fullmatch(command.words[index])):
        assignments.append((match.group(1), shell.expand(match.group(2))))
        index += 1
    words = command.words[index:]
    if not words:
        for name, expanded in assignments:
            shell.assign(name, expanded)
            if relevant(name) and name not in shell.exported:
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
    engine_at = next((k for k, f in enumerate(fields) if posixpath.basename(f) in ENGINES and fields[k + 1 : k + 2] == ["run"]), None)
    if engine_at is not None:
        if "sudo" in fields[:engine_at]:
            result.notes.append(f"line {line}: sudo not needed: the gb10d user is allowed on the engine's socket instead (see the README, \"vLLM in a container\")")
        wrappers([w for w in fields[:engine_at] if w != "sudo"], line, result)
        if result.found == 0:
            # An image or a model from a variable the script never sets is kept as written: say so, as for vllm serve.
            for expanded in [*expansions, *(e for _, e in assignments)]:
                _warn_unknowns(result, line, expanded)
        container_command(shell, fields[engine_at:], command, result)
        return
    start = vllm_start(fields)
    if start is not None:
        wrappers(fields[:start], line, result)
        if result.found == 0:
            for expanded in [*expansions, *(e for _, e in assignments)]:
                _warn_unknowns(result, line, expanded)
        vllm_command(shell, fields[start:], [(n, " ".join(e.fields)) for n, e in assignments], command, result)
        return
    _other(fields, command, result)


def _warn_unknowns(result: Findings, line: int, expanded: Expansion) -> None:
    for name in expanded.missing:
        result.warnings.append(f"line {line}: {name} is not set in the script; the value was kept as written, replace it")
    for text in expanded.unsupported:
        result.warnings.append(f"line {line}: {text} cannot be evaluated without running it; the text was kept as written, replace it")


def _declare(shell: Shell, program: str, words: list[str], line: int, result: Findings) -> None:
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
        elif NAME.fullmatch(word):
            name = word
        else:
            result.warnings.append(f"line {line}: {program} {word!r} is not understood")
            continue
        if exporting:
            shell.exported.add(name)


def _source(fields: list[str], line: int, result: Findings) -> None:
    """`source VENV/bin/activate` names the venv; other sourced files cannot be followed."""
    target = fields[0] if fields else ""
    if posixpath.basename(target) == "activate" and posixpath.basename(posixpath.dirname(target)) == "bin":
        result.venv = result.absolute(posixpath.dirname(posixpath.dirname(target)), line, "venv")
        return
    result.warnings.append(
        f"line {line}: source {target!r} was not read; if it sets variables vLLM needs, add them to [vllm.env]"
    )


def _other(fields: list[str], command: Command, result: Findings) -> None:
    """A command that is not the vllm one: ignored with a note when harmless, else a warning."""
    name = posixpath.basename(fields[0]) if fields else ""
    text = shlex.join(fields)
    if "drop_caches" in text:
        result.notes.append(f"line {command.line}: page-cache dropping is done by gb10d itself ([memory] evict_page_cache)")
    elif name in HARMLESS:
        result.ignored.append(f"{name} (line {command.line})")
    elif name in STOPPERS:
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


def _block(shell: Shell, block: Block, result: Findings) -> None:
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
        elif vllm_start(fields) is not None:
            runs_vllm = True
            _interpret(shell, command, result)
        elif name not in HARMLESS | STOPPERS:
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
