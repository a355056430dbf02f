"""How vLLM runs: the interface an attempt drives, whatever runs vLLM underneath.

An attempt needs the same few things from any way of running vLLM: its
output as two byte streams, its exit status as soon as it exits, a stop
ladder (SIGTERM, grace, SIGKILL, until nothing is left), whether anything of
it is still alive, and how many bytes it has read and written (a silent load
still reads). `Runtime` is that interface; `Launcher` makes one per attempt
and knows the command line that will really run (what `print-command` and
the journal show), the environment vLLM gets, what must be fetched before a
start (a container image, pulled with progress), and what an earlier gb10d
may have left behind.

The local process group (`process.ProcessGroup`, started by `LocalLauncher`)
is the first implementation. A container engine (`container.ContainerRuntime`,
started by `container.ContainerLauncher`) is the second.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Mapping, Protocol, Sequence

from ..base.command import build_env
from ..base.config import VllmSection
from ..base.image import PreparedImage, PullProgress
from .process import ChunkHandler, ProcessGroup

Escalation = Callable[[list[int]], None]


class Runtime(Protocol):
    """One running vLLM, however it runs."""

    @property
    def pid(self) -> int:
        """The process gb10d started (the API server, or the engine's client), for the journal."""
        ...

    @property
    def label(self) -> str:
        """How the journal names it: `pid 4242`, or a container's name and its client's pid."""
        ...

    @property
    def reaches(self) -> str:
        """What its stop ladder reaches, for the journal: `its process group`, `its container`."""
        ...

    def readers(self, on_stdout: ChunkHandler, on_stderr: ChunkHandler) -> list[Awaitable[None]]:
        """Coroutines that drain vLLM's stdout and stderr until EOF, handing each chunk over at once."""
        ...

    async def wait(self) -> int:
        """The exit status (negative for a signal) as soon as vLLM's main process exits."""
        ...

    def alive(self) -> bool:
        """Whether any process of it is left (zombies included)."""
        ...

    async def stop(self, grace_s: float, on_escalate: Escalation | None = None) -> bool:
        """SIGTERM, `grace_s` to exit, then SIGKILL; True when nothing of it is left."""
        ...

    async def kill(self, on_escalate: Escalation | None = None) -> bool:
        """SIGKILL everything of it now; True when nothing is left."""
        ...

    def io_bytes(self) -> int | None:
        """Bytes read and written so far by all of its processes; None when they cannot be read."""
        ...

    def members(self) -> list[int]:
        """The pids still left, for messages about survivors."""
        ...


class Launcher(Protocol):
    """Starts vLLM the configured way, once per attempt."""

    def environment(self, vllm: VllmSection, added: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
        """vLLM's environment: gb10d's own plus its additions for a process, only the additions in a container.

        `added` is what a correction adds (`Tunables.env`), where the config sets no value of its own.
        """
        ...

    async def prepare(self, on_progress: Callable[[PullProgress], None]) -> PreparedImage | None:
        """Fetch what vLLM runs from, if it must be (a container image), reporting each step as progress.

        Returns which image will start (None for a local program); raises
        PullFailed, which is not worth retrying at once.
        """
        ...

    def command_line(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """The argv that will really run for vLLM's `argv` (what the journal and print-command show)."""
        ...

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Runtime:
        """Start vLLM; raises SpawnError when it cannot start at all."""
        ...

    async def clear_leftovers(self) -> str | None:
        """Remove what a gb10d that died without stopping vLLM left behind; what was removed, or None."""
        ...


class LocalLauncher:
    """vLLM as a child process group of gb10d (a venv or an executable)."""

    def environment(self, vllm: VllmSection, added: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
        return build_env(vllm, added=added)

    async def prepare(self, on_progress: Callable[[PullProgress], None]) -> PreparedImage | None:
        return None  # the venv or executable is there or not; check-config says which

    def command_line(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return list(argv)

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Runtime:
        return await ProcessGroup.spawn(argv, env)

    async def clear_leftovers(self) -> str | None:
        # A process group dies with gb10d's unit (KillMode=mixed), and subreaping adopts what a crashed
        # gb10d's vLLM left in a terminal session: there is nothing of a previous gb10d to find by name.
        return None
