"""Progress-bar redraws: which of tqdm's many redraws of a bar are worth a journal line.

A bar redrawn ten times a second would bury every other line; its start, its steps and its end are what an
operator reads.
"""

from __future__ import annotations

import re

from .classify import _SHARD_BAR, _TAG_STR, _TQDM_BAR, _TQDM_OPEN_BAR

# --- progress-bar collapsing ---------------------------------------------------


class BarCollapser:
    """Decides which progress-bar states reach the journal, so a bar costs a few lines, not thousands.

    - Shard bars (`Loading safetensors checkpoint shards`): a line each time
      the count n/N changes, so every shard step is visible and tqdm's
      repeated final state is not. A new 0/N pass (the MTP drafter loads the
      checkpoint again) is a change and is forwarded.
    - Every other tqdm bar (CUDA graph capture, Hugging Face downloads,
      `Fetching N files`): the first state, each new 10% decile, and the final
      state, once per bar (bars are told apart by process tag and description).
    - Blank lines (tqdm's closing newline, padding) are dropped: they carry nothing.
    - Every other line is forwarded.
    """

    _MAX_BARS = 512  # download bars are per file; forget the oldest beyond this

    def __init__(self) -> None:
        self._last: dict[tuple[str | None, str], tuple[int, int]] = {}

    def forward(self, text: str) -> bool:
        """Whether this line should be written to the journal."""
        if "%" not in text:
            if "/s]" in text or "s/it]" in text:
                return self._open_bar(text)
            if text.endswith(" "):
                return bool(text.strip()) and not _is_blank_tagged(text)
            return bool(text)
        tag = None
        body = text
        if text.startswith("("):
            t = _TAG_STR.match(text)
            if t is not None:
                tag, body = t.group(0), text[t.end():]
        if "% Completed |" in body:
            s = _SHARD_BAR.search(body)
            if s is not None:
                return self._changed((tag, s.group("desc")), (int(s.group("n")), int(s.group("total"))))
        if "%|" in body:
            b = _TQDM_BAR.match(body)
            if b is not None:
                return self._decile((tag, b.group("desc")), int(b.group("pct")), b)
        return True

    def _open_bar(self, text: str) -> bool:
        """A bar without a total: its first state, then one per 30 s of its own elapsed time."""
        tag, body = None, text
        if text.startswith("("):
            t = _TAG_STR.match(text)
            if t is not None:
                tag, body = t.group(0), text[t.end():]
        b = _TQDM_OPEN_BAR.match(body)
        if b is None:
            return True
        elapsed_s = int(b.group("h") or 0) * 3600 + int(b.group("m")) * 60 + int(b.group("s"))
        return self._changed((tag, b.group("desc")), (elapsed_s // 30, -1))

    def _remember(self, key: tuple[str | None, str], value: tuple[int, int]) -> None:
        self._last.pop(key, None)
        self._last[key] = value
        if len(self._last) > self._MAX_BARS:
            del self._last[next(iter(self._last))]

    def _changed(self, key: tuple[str | None, str], state: tuple[int, int]) -> bool:
        if self._last.get(key) == state:
            return False
        self._remember(key, state)
        return True

    def _decile(self, key: tuple[str | None, str], pct: int, m: re.Match[str]) -> bool:
        final = _scaled(m.group("n"), m.group("nu")) >= _scaled(m.group("total"), m.group("tu"))
        # States: decile 0..9 for running, 10 for done; forward when it rises, or when the bar restarts.
        state = 10 if final else min(pct // 10, 9)
        last = self._last.get(key)
        if last is not None and (state == last[0] or 0 < state < last[0]):
            return False
        self._remember(key, (state, 0))
        return True


def _is_blank_tagged(text: str) -> bool:
    if text.startswith("("):
        t = _TAG_STR.match(text)
        return t is not None and not text[t.end():].strip()
    return False


_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}


def _scaled(number: str, unit: str) -> float:
    try:
        return float(number) * _SCALE[unit]
    except ValueError:
        return 0.0
