"""Reading vLLM's output: framing bytes into lines, classifying lines, and parsing them into events.

Everything here is pure and synchronous, because the daemon runs it for
every byte vLLM prints on both pipes (well over 100,000 lines a second must be
possible) and `diagnose` runs it over pasted logs. The formats are those of
vLLM 0.23 to 0.34 (both process-tag eras), uvicorn, tqdm and Python
tracebacks; where the reference and a real recording differ, the recording
wins.

Four pieces, used in this order, each a module of this package:

- `framing.LineFramer` turns raw pipe bytes into `Line`s (UTF-8 with
  replacement, `\\n` framing, `\\r` redraws as they happen, ANSI stripped,
  runaway lines capped).
- `classify.Classifier` (or the stateless `classify`) tells a line's process
  tag, level, source and kind, and the syslog priority it deserves in the
  journal; it remembers when it is inside a traceback.
- `bars.BarCollapser` decides which progress-bar redraws are worth a journal line.
- `scan.parse_line` / `scan.EventScanner` turn lines into `events.Event`s
  (with `patterns`' expressions and `failures`' templates); `EventScanner`
  also joins a failure message that was split over two lines.

The names below are the package's public surface; the modules' other names are its own.
"""

from .bars import BarCollapser
from .classify import Classifier, Kind, Record, classify, message_of
from .framing import MAX_LINE_BYTES, Line, LineFramer
from .scan import EventScanner, parse_line, parse_message

__all__ = [
    "MAX_LINE_BYTES", "BarCollapser", "Classifier", "EventScanner", "Kind", "Line", "LineFramer", "Record",
    "classify", "message_of", "parse_line", "parse_message",
]
