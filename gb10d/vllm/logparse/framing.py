"""Framing vLLM's pipe bytes into lines: UTF-8 with replacement, `\n` framing, `\r` redraws as they happen,
ANSI stripped, runaway lines capped, and the process tags (`(EngineCore pid=N) `) split off.

The first step of every byte vLLM prints: it runs for well over 100,000 lines a second, so it works on bytes
and touches each line once.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# --- framing ----------------------------------------------------------------

MAX_LINE_BYTES = 64 * 1024
"""A line longer than this is cut: vLLM's longest real line (the engine config dump) is ~6 KiB."""

_ANSI_B = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
# Process names are words (`EngineCore_DP0`, `Worker_TP0`); 0.9-0.10 also wrote `VllmWorker rank=0`.
_NAME = r"[\w.\[\]=-]+(?: [\w.\[\]=-]+)?"
# Ray forwards an actor's lines behind its own tag, `(RayWorkerProc pid=N, ip=ADDR) ` (no `ip=` for the
# driver's node), after the EngineCore's tag and before vLLM's own one in the actor: a line can carry a
# chain, `(EngineCore pid=1) (RayWorkerProc pid=2, ip=10.0.0.2) (Worker pid=2) INFO ...`.
_ONE_TAG = r"\(" + _NAME + r" pid=\d+(?:, ip=[0-9A-Fa-f.:]+)?\) "
_TAGS_B = re.compile(rb"(?:" + _ONE_TAG.encode() + rb")+")


class Line(NamedTuple):
    """One logical line of output, clean text without its line ending.

    `redraw` is true for a `\\r` refresh (a tqdm bar state); `truncated` marks
    a line cut at `MAX_LINE_BYTES`, whose rest up to the next newline is dropped.
    """

    text: str
    redraw: bool = False
    truncated: bool = False


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _cut(raw: bytes, limit: int) -> bytes:
    """`raw` cut to at most `limit` bytes, not inside a UTF-8 sequence (so no stray replacement char)."""
    end = limit
    # Step back over continuation bytes (10xxxxxx) to the start of the cut character.
    while end > 0 and (raw[end] & 0xC0) == 0x80 and limit - end < 4:
        end -= 1
    return raw[:end]


class LineFramer:
    """Frames one pipe's bytes into `Line`s, the same whatever the read sizes are.

    `\\n` ends a line; one `\\r` before it is part of the ending (vLLM's
    multi-line records end their physical lines in `\\r\\n`). Any other `\\r`
    is a tqdm redraw: each redraw state is emitted as soon as the next `\\r`
    shows it is complete, so a bar that never prints `\\n` until it closes
    (CUDA graph capture) is still seen live. A 0.23-0.30 process tag written
    before the first `\\r` is kept on every redraw, so each line still says
    which process printed it. Blank redraw states (tqdm's padding spaces) are
    dropped.
    """

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._max = max_line_bytes
        self._buf = b""
        # The current physical line already had redraw states emitted; its
        # next segment is a redraw too and carries this tag.
        self._continuing = False
        self._tag = b""
        self._discarding = False

    def feed(self, data: bytes) -> list[Line]:
        """Frame `data`; returns the lines it completed (possibly none)."""
        out: list[Line] = []
        if self._discarding:
            cut = data.find(b"\n")
            if cut < 0:
                return out
            data = data[cut + 1 :]
            self._discarding = False
        buf = self._buf + data if self._buf else data
        last_nl = buf.rfind(b"\n")
        if last_nl >= 0:
            self._buf = buf[last_nl + 1 :]
            physical = buf[:last_nl].split(b"\n")
            if self._continuing:
                self._continuing = False
                self._segments(physical[0], out, continuing=True)
                physical = physical[1:]
            for raw in physical:
                if b"\r" in raw or b"\x1b" in raw or len(raw) > self._max:
                    self._segments(raw, out, continuing=False)
                else:
                    out.append(Line(raw.decode("utf-8", "replace")))
        else:
            self._buf = buf
        if b"\r" in self._buf:
            self._soft(out)
        if len(self._buf) > self._max:
            self._emit(self._tag + self._buf if self._continuing else self._buf, self._continuing, out)
            self._buf = b""
            self._continuing = False
            self._discarding = True
        return out

    def flush(self) -> list[Line]:
        """The unterminated rest, as if a newline followed (call at end of stream)."""
        out: list[Line] = []
        rest, self._buf = self._buf, b""
        if rest or self._continuing:
            continuing, self._continuing = self._continuing, False
            self._segments(rest, out, continuing=continuing)
        self._discarding = False
        return out

    def _soft(self, out: list[Line]) -> None:
        """Emit the redraw states of the unterminated line that a later `\\r` has completed."""
        buf = self._buf
        last = buf.rfind(b"\r")
        if last == len(buf) - 1:
            # A trailing \r may be the first half of \r\n: not a boundary yet.
            last = buf.rfind(b"\r", 0, last)
        if last < 0:
            return
        done, self._buf = buf[:last], buf[last + 1 :]
        self._segments(done + b"\r", out, continuing=self._continuing, complete=False)
        self._continuing = True

    def _segments(self, raw: bytes, out: list[Line], continuing: bool, complete: bool = True) -> None:
        """Split one physical line (or its completed part) at `\\r` and emit each state."""
        if complete and raw.endswith(b"\r"):
            raw = raw[:-1]
        if b"\x1b" in raw:
            raw = _ANSI_B.sub(b"", raw)
        parts = raw.split(b"\r")
        if not complete:
            parts.pop()  # the empty piece after the final \r
        if continuing:
            for part in parts:
                if part.strip():
                    self._emit(self._tag + part, True, out)
            return
        first = parts[0]
        if complete and len(parts) == 1:
            self._emit(first, False, out)
            return
        tag = _TAGS_B.match(first)
        self._tag = tag.group(0) if tag else b""
        head = first[len(self._tag) :]
        if head.strip():
            self._emit(first, False, out)
        for part in parts[1:]:
            if part.strip():
                self._emit(self._tag + part, True, out)

    def _emit(self, raw: bytes, redraw: bool, out: list[Line]) -> None:
        if len(raw) > self._max:
            out.append(Line(_decode(_cut(raw, self._max)), redraw, True))
        else:
            out.append(Line(_decode(raw), redraw))
