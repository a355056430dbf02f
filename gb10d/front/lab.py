"""`gb10d front` as a real child process, for the tests and the benchmark (as gb10d.daemon.lab runs `gb10d run`)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path
from typing import Self

from ..daemon.lab import DEADLINE_S, LineReader, clean_env, kill_group


class FrontChild:
    """`gb10d --config CONFIG front` in a session of its own, its journal lines read as they come."""

    def __init__(self, config: Path, nofile: int | None = None) -> None:
        """`nofile`: the front's open-file limit, soft and hard (as a unit's LimitNOFILE= sets it)."""

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gb10d", "--config", str(config), "front"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True, preexec_fn=limit,
        )
        assert self.proc.stdout is not None
        self.out = LineReader(self.proc.stdout)

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S) -> str:
        """The first line matching `pattern`, or AssertionError with what the front said."""
        found = self.out.wait_line(pattern, timeout)
        if found is None:
            raise AssertionError(f"the front wrote no line matching {pattern!r} (exit {self.proc.poll()}):\n{self.out.tail()}")
        return found.item

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        self.out.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
