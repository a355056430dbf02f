"""A start script's shell syntax: the simple commands it is made of, and the compound blocks around them.

This is bash's grammar for the parts a start script uses (backslash continuations, comments, `;`, `&&`, `|`, `&`,
redirections, `if`, loops, `case`, `{ }`), apart from what any command means to gb10d. Words are scanned here
as written (quote-aware, keeping the quotes, `${}` and `$()` whole) because their expansion
(shellexpansion) depends on the quotes; each command keeps its line, so that every note can say where.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_OPERATOR_CHARS = ";&|<>\n"
# Compound commands: the word that opens one, and the word that closes it.
_OPENERS = {"if": "fi", "for": "done", "while": "done", "until": "done", "case": "esac", "{": "}"}
# Words that start a command inside a compound one (`then rm x` runs `rm x`).
_INNER_KEYWORDS = {"then", "elif", "else", "do", "if", "while", "until", "!"}


@dataclass
class Command:
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
            end = matching_bracket(text, i + 1, open_char, ")" if open_char == "(" else "}")
            i = n if end < 0 else end + 1
        elif c == "`":
            end = text.find("`", i + 1)
            i = n if end < 0 else end + 1
        else:
            i += 1
    return i


def split_commands(text: str) -> list[Command]:
    """Split a script into simple commands, handling continuations, comments and operators."""
    commands: list[Command] = []
    line = 1
    current = Command(line)
    piped = False
    i, n = 0, len(text)
    word_end = -1
    heredocs: list[str] = []  # the delimiters of the here-documents whose bodies start after this line

    def finish(background: bool = False, pipe_next: bool = False) -> None:
        nonlocal current, piped
        if current.words or current.redirects:
            current.background = background
            current.piped_from = piped
            commands.append(current)
        piped = pipe_next
        current = Command(line)

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
            if heredocs:
                i, line = _skip_heredocs(text, i, line, heredocs)
                heredocs = []
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
            if op.endswith("<<") and not op.endswith("<<<"):
                heredocs.append(text[i:target_end])
            line += text.count("\n", i, target_end)
            i = target_end
        else:
            end = _read_word(text, i)
            current.words.append(text[i:end])
            line += text.count("\n", i, end)
            i = word_end = end
    finish()
    return commands


def _skip_heredocs(text: str, i: int, line: int, delimiters: list[str]) -> tuple[int, int]:
    """Past the bodies of the here-documents that start at `i`: their lines are data for a command, not commands.

    `<<-WORD` also ends at a line of tabs and WORD; quotes around WORD only turn expansion off in the body. A body
    without its last line runs to the end, as bash reads it. Returns the index and line number after the bodies.
    """
    for delimiter in delimiters:
        tabs = delimiter.startswith("-")
        word = delimiter.removeprefix("-").replace('"', "").replace("'", "").replace("\\", "")
        while i < len(text):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            body_line = text[i:end]
            i = end + 1
            line += 1
            if (body_line.lstrip("\t") if tabs else body_line) == word:
                break
    return min(i, len(text)), line


@dataclass
class Block:
    """A compound command (`if ... fi`, a loop, `case`, `{ }`): its lines, its text, and the simple commands in it.

    The script is read as if every command ran once, so a block is judged as
    one thing: harmless, holding the vLLM command, or something gb10d does
    not reproduce; one note or warning each, not one per keyword.
    """

    first: int
    last: int
    text: str
    commands: list[Command] = field(default_factory=list)


def group_blocks(commands: list[Command]) -> list[Command | Block]:
    """Group the simple commands into top-level commands and compound blocks, stripping the keywords inside."""
    items: list[Command | Block] = []
    block: Block | None = None
    closers: list[str] = []
    for command in commands:
        words = command.words
        opener = words[0] if words else ""
        if block is None and opener not in _OPENERS:
            items.append(command)
            continue
        if block is None:
            block = Block(command.line, command.line, "")
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
            block.commands.append(Command(command.line, inner, command.redirects, command.background, command.piped_from))
        if not closers:
            block = None
    return items


def matching_bracket(text: str, start: int, open_char: str, close_char: str) -> int:
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
