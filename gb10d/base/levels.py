"""Syslog priorities, the one definition: journald's `<N>` prefixes and `PRIORITY=` fields use them."""

from __future__ import annotations

PRIORITY_ERR = 3
PRIORITY_WARNING = 4
PRIORITY_INFO = 6
PRIORITY_DEBUG = 7
