"""gb10d's words in the journal, and the alerts that follow them.

Every decision line gb10d says goes to the journal with its event kind and
`GB10D_*` fields, and to the `AlertSender`, which picks the lines that are
alerts (`[alerts]` webhooks). Lines of a child's own output (Ray's) are
forwarded at their own priority. The `Reporter` speaks through it; a
dropped alert is said past the alerts, which could not carry it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Callable

from ..base.command import read_env_file
from ..base.config import Config
from ..base.errors import ConfigError
from ..base.levels import PRIORITY_WARNING
from ..machine.journal import Journal
from .alerting import AlertSender

# How long queued alerts get to go out when gb10d exits (a give-up's alert is sent then).
ALERTS_CLOSE_S = 10.0


class Voice:
    """The journal and the alerts of one config (asked for at each alert: a reload changes `[alerts]`)."""

    def __init__(self, config: Callable[[], Config], journal: Journal) -> None:
        self._config = config
        self.journal = journal
        self.alerts = AlertSender(config().alerts, config().vllm.served_names[0], self._alert_environment, self._alert_dropped)

    def say(self, kind: str, message: str, priority: int, fields: dict[str, object]) -> None:
        """One decision line in the journal; an alert too, if it is one."""
        self.journal.event(kind, message, priority, **fields)
        self.alerts.journaled(kind, message, fields)

    def forward(self, lines: Sequence[tuple[str, int]]) -> None:
        """Lines of a child's own output, each at its priority, in the journal at once."""
        for text, priority in lines:
            self.journal.vllm_line(text, priority)
        self.journal.flush()

    def reconfigured(self) -> None:
        """A reload applied: later alerts go where its `[alerts]` says."""
        self.alerts.section = self._config().alerts

    def close(self) -> None:
        """Queued alerts get ALERTS_CLOSE_S to go out; the journal has every line."""
        self.alerts.close(ALERTS_CLOSE_S)
        self.journal.flush()

    def _alert_environment(self) -> dict[str, str]:
        """Where ${NAME} in a webhook comes from: gb10d's environment, then vllm.env_file."""
        env_file = self._config().vllm.env_file
        try:
            return {**os.environ, **(read_env_file(env_file) if env_file else {})}
        except ConfigError:
            return dict(os.environ)

    def _alert_dropped(self, text: str) -> None:
        self.journal.event("alert_dropped", text, PRIORITY_WARNING)
