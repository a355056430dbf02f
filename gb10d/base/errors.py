"""One error tree for gb10d, each class one line of plain words.

Exit statuses live here too, because the unit file, the README and the
supervisor must agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_NOT_RUNNING = 3  # `gb10d status`, as LSB's status action: not running
EXIT_STATUS_UNKNOWN = 4  # `gb10d status`, as LSB's: the state cannot be read
EXIT_USAGE = 64  # EX_USAGE: the command line is wrong
EXIT_NO_INPUT = 66  # EX_NOINPUT: a file named on the command line cannot be read
EXIT_GAVE_UP = 75  # EX_TEMPFAIL: retries exhausted; systemd may try again later
EXIT_MEMORY_NOT_RETURNED = 76  # EX_PROTOCOL slot: memory stayed taken after vLLM exited
EXIT_CONFIG = 78  # EX_CONFIG: the unit has RestartPreventExitStatus=78
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C at the terminal


class Gb10dError(Exception):
    """Something gb10d cannot do, explained for the operator."""

    exit_status: int = EXIT_FAILURE


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration file, located as precisely as known."""

    path: str
    key: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.path
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        if self.key:
            return f"{where}: {self.key}: {self.message}"
        return f"{where}: {self.message}"


class ConfigError(Gb10dError):
    """The configuration is invalid; nothing was started."""

    exit_status = EXIT_CONFIG

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class UsageError(Gb10dError):
    """The command line asks for something that cannot be (a user this machine lacks); nothing was done."""

    exit_status = EXIT_CONFIG


class SpawnError(Gb10dError):
    """vLLM could not be started at all (missing or non-executable program)."""

    exit_status = EXIT_CONFIG


class MemInfoError(Gb10dError, ValueError):
    """A meminfo text lacks a figure gb10d needs."""


class LedgerUnavailable(Gb10dError):
    """The memory ledger's directory cannot be used; the message says why and what fixes it."""


class GiveUp(Gb10dError):
    """gb10d stopped trying; the reason says why and what to do. `told`: the journal has the reason already, in the
    failure's own line (its event kind, with the cause), which must not be repeated."""

    def __init__(self, reason: str, exit_status: int, told: bool = False) -> None:
        self.reason = reason
        self.exit_status = exit_status
        # The journal has the reason already, in the failure's own line: said once is enough.
        self.told = told
        super().__init__(reason)
