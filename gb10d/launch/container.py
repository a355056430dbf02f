"""vLLM in a container: docker or podman runs the image, gb10d drives the engine's client.

The container's processes are not gb10d's children: the engine's shim owns
them, systemd's KillMode does not reach them, and a SIGKILL of the client
leaves them running. So gb10d names and labels its container after its
config, stops and removes it through the engine, and removes a container of
its own that an earlier gb10d left behind before each start. The client runs
attached, so its stdout and stderr are vLLM's and its exit status is the
container's. The gb10d user cannot read /proc/PID/io of the container's
processes (they belong to root), so the I/O that shows a silent load is alive
is read from the container's cgroup instead.

The engine's client is `engine`, the cgroup readings `cgroup`, the image
`image`; here are the container of one attempt and what starts it. What the
engine's refusal to run means, and a container's exit status, are decided
in gb10d.core.containerstart; the classes here only run the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Mapping, Sequence

from ..base.backoff import pauses
from ..base.command import CONTAINER_LABEL, Engine, build_env, container_argv, container_name, inherited_env
from ..base.config import Config, VllmSection
from ..base.errors import SpawnError
from ..base.image import PreparedImage
from ..core.containerstart import refused_before_vllm, run_failure, signal_status
from .cgroup import ContainerCgroup
from .engine import ENGINE_TIMEOUT_S, EngineResult, EngineUnavailable, engine_call, running_user, unreachable_advice, unreachable_error
from .image import ProgressHandler, prepare_image
from .process import ChunkHandler, ProcessGroup
from .runtime import Escalation

# How long a started container may take to have a process (GPU hooks and a cold storage driver take seconds).
START_TIMEOUT_S = 60.0
# Pauses before asking again to remove a container the engine still shows after `rm --force` (about 3.5 s in all).
REMOVE_AGAIN_S = (0.5, 1.0, 2.0)


# --- the container of one attempt ----------------------------------------------------------------------


class ContainerRuntime:
    """One running container: the attached client gb10d started, and the container the engine runs for it."""

    reaches = "its container"

    def __init__(self, client: ProcessGroup, engine: Engine, name: str, env: Mapping[str, str], cgroup: ContainerCgroup | None) -> None:
        self._client = client
        self._engine = engine
        self.name = name
        self._env = dict(env)
        self._cgroup = cgroup
        self._removed = False

    @property
    def pid(self) -> int:
        return self._client.pid

    @property
    def label(self) -> str:
        return f"container {self.name} ({self._engine.kind} run pid {self._client.pid})"

    def readers(self, on_stdout: ChunkHandler, on_stderr: ChunkHandler) -> list[Awaitable[None]]:
        """The client's pipes: the container's stdout and stderr."""
        return self._client.readers(on_stdout, on_stderr)

    async def wait(self) -> int:
        """The container's exit status once its main process exits (a signal as -N).

        The client normally exits with the container. If the client itself was
        killed while the container runs on, the engine is asked to wait for it.
        """
        status = await self._client.wait()
        state = await self._state()
        if state is None:  # already removed (a stop): the client's status is the container's
            return signal_status(status) if status >= 0 else status
        running, exit_code = state
        if running:
            result = await engine_call(self._engine, "wait", self.name, env=self._env, timeout_s=None)
            state = await self._state()
            exit_code = state[1] if state is not None else int(result.stdout.strip() or 0)
        return signal_status(exit_code)

    async def _state(self) -> tuple[bool, int] | None:
        """(running, exit code) of the container; None once it is removed."""
        result = await engine_call(self._engine, "container", "inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", self.name, env=self._env)
        fields = result.stdout.split()
        if result.status != 0 or len(fields) != 2:
            return None
        return fields[0] == "true", int(fields[1])

    def alive(self) -> bool:
        """Whether anything of it is left: the client, a process of the container, or the container itself until removed.

        An exited container stays with the engine until it is removed, so
        the attempt that saw it exit still removes it.
        """
        return not self._removed or self._client.alive() or bool(self._container_pids())

    def _container_pids(self) -> list[int]:
        return self._cgroup.procs() if self._cgroup is not None else []

    def members(self) -> list[int]:
        """The container's processes (host pids) and the client, while they last."""
        return self._container_pids() + ([self._client.pid] if self._client.alive() else [])

    def io_bytes(self) -> int | None:
        """The container's I/O count from its cgroup (see ContainerCgroup)."""
        return self._cgroup.io_bytes() if self._cgroup is not None else None

    async def stop(self, grace_s: float, on_escalate: Escalation | None = None) -> bool:
        """SIGTERM through the engine, `grace_s` for vLLM to drain, then SIGKILL; remove the container; True when nothing is left."""
        await self._tell("kill", "--signal", "TERM", self.name)
        if await self._ended(grace_s):
            return await self._remove()
        return await self.kill(on_escalate)

    async def kill(self, on_escalate: Escalation | None = None) -> bool:
        """SIGKILL the container and remove it; True when nothing of it is left.

        The SIGKILL goes first because podman's `rm -f` would give the container
        its stop timeout again before killing it.
        """
        if on_escalate is not None:
            on_escalate(self.members())
        await self._tell("kill", "--signal", "KILL", self.name)
        return await self._remove()

    async def _tell(self, *args: str) -> EngineResult | None:
        """One engine command on the way to stopping; None when the engine did not answer (the caller then finds the container still there)."""
        try:
            return await engine_call(self._engine, *args, env=self._env)
        except EngineUnavailable:
            return None

    async def _ended(self, timeout_s: float) -> bool:
        """Wait for the container's main process to exit, at most `timeout_s`: on the client, or on the engine once the client is gone."""
        try:
            if self._client.alive():
                await asyncio.wait_for(self._client.wait(), timeout_s)
            else:
                await engine_call(self._engine, "wait", self.name, env=self._env, timeout_s=timeout_s)
        except (asyncio.TimeoutError, EngineUnavailable):
            return False
        return True

    async def _remove(self) -> bool:
        """`rm -f` the container, then wait for the client to exit; True when neither is left.

        An engine can fail to remove a container it is still tearing down (docker, under I/O load: the exited
        container's filesystem "device or resource busy"), so a container still there is asked for again, a few
        times, before it counts as left.
        """
        await self._tell("rm", "--force", self.name)
        if self._client.alive():
            try:
                await asyncio.wait_for(self._client.wait(), ENGINE_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._client.kill()
        inspect = ("container", "inspect", "--format", "{{.Id}}", self.name)
        seen = await self._tell(*inspect)
        for pause in REMOVE_AGAIN_S:
            if seen is None or seen.status != 0:  # gone, or the engine does not answer: asking again will not help
                break
            await asyncio.sleep(pause)  # a back-off before asking the engine again, not a wait for an event
            await self._tell("rm", "--force", self.name)
            seen = await self._tell(*inspect)
        self._removed = seen is not None and seen.status != 0
        return not self.alive()


class ContainerLauncher:
    """Starts vLLM in the configured image, once per attempt, and clears what an earlier gb10d left."""

    def __init__(self, config: Config, config_path: Path, engine: Engine) -> None:
        assert config.vllm.image is not None
        self.config = config
        self.config_path = config_path
        self.engine = engine
        self.name = container_name(config.container, config_path)
        self.image = config.vllm.image

    def environment(self, vllm: VllmSection, added: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
        """The container's environment: gb10d's defaults, the cache variables, env_file, [vllm.env] and `added` (not the host's)."""
        return build_env(vllm, base={}, added=added)

    def command_line(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return container_argv(self.config, self.config_path, self.engine, argv, env)

    def _client_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The client's own environment: gb10d's (PATH, HOME for registry credentials), less systemd's, plus the values of `-e NAME`."""
        return inherited_env() | dict(env)

    async def prepare(self, on_progress: ProgressHandler) -> PreparedImage:
        """Make sure the image is present as container.pull says, pulling it with progress; which image will start, and as what."""
        prepared = await prepare_image(self.engine, self.image, self.config.container.pull, on_progress, self._client_env({}))
        return replace(prepared, container=self.name, engine=self.engine.kind)

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> ContainerRuntime:
        """Run the container attached; returns once it has a process, or raises SpawnError with the engine's reason."""
        cache = self.config.container.cache_dir
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpawnError(f"cannot create container.cache_dir {cache}: {exc.strerror or exc}; create it, owned by the user running gb10d") from None
        client_env = self._client_env(env)
        client = await ProcessGroup.spawn(self.command_line(argv, env), client_env, name=f"{self.engine.kind} run", key="container.engine")
        running = await self._container_pid(client, client_env)
        runtime = ContainerRuntime(client, self.engine, self.name, client_env, ContainerCgroup.of(*running) if running else None)
        if running is not None:
            return runtime
        if client.alive():
            await runtime.kill()
            raise EngineUnavailable(f"{self.engine.kind} did not start the container {self.name} within {START_TIMEOUT_S:g} s; see {self.engine.kind} info and its log")
        status = await client.wait()
        started = await engine_call(self.engine, "container", "inspect", "--format", "{{.State.StartedAt}}", self.name, env=client_env)
        if refused_before_vllm(status, started.status == 0, started.stdout):
            # Its reason is all the client printed.
            stderr = await _read_all(client)
            await engine_call(self.engine, "rm", "--force", self.name, env=client_env)
            advice = unreachable_advice(self.engine, stderr, running_user())
            last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {status}"
            raise EngineUnavailable(f"{self.engine.kind} run failed: {last}; {advice}" if advice else run_failure(self.engine, self.image, stderr, status))
        return runtime  # vLLM ran and exited at once: its output and status tell why

    async def _container_pid(self, client: ProcessGroup, env: Mapping[str, str]) -> tuple[int, str] | None:
        """The host pid of the container's first process once it runs, and the container's id; None when the client exited first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        delays = pauses(0.05, 0.5)
        exited = asyncio.ensure_future(client.wait())
        try:
            while loop.time() < deadline:
                result = await engine_call(self.engine, "container", "inspect", "--format", "{{.State.Running}} {{.State.Pid}} {{.Id}}", self.name, env=env)
                running, pid, cid = (result.stdout.split() + ["", "", ""])[:3]  # docker shows a pid already while it creates the container
                if result.status == 0 and running == "true" and pid.isdigit() and int(pid) > 0:
                    return int(pid), cid
                # Until the engine has created it, wait for the client to exit or a moment to pass.
                done, _ = await asyncio.wait({exited}, timeout=next(delays))
                if done:
                    return None
        finally:
            exited.cancel()
        return None

    async def clear_leftovers(self) -> str | None:
        """Remove this config's container left by a gb10d that died without stopping it; what was removed, or None.

        A container by the same name that gb10d did not start (another label,
        or none) is not touched: SpawnError says whose it is.
        """
        env = self._client_env({})
        label = f"{CONTAINER_LABEL}={self.config_path}"
        listed = await engine_call(self.engine, "ps", "--all", "--filter", f"label={label}", "--format", "{{.ID}} {{.Names}} {{.Status}}", env=env)
        if listed.status != 0:
            raise unreachable_error(self.engine, listed, "ps")
        owner = await engine_call(self.engine, "container", "inspect", "--format", f'{{{{index .Config.Labels "{CONTAINER_LABEL}"}}}}', self.name, env=env)
        if owner.status == 0 and owner.stdout.strip() != str(self.config_path):
            whose = f"the gb10d of {owner.stdout.strip()}" if owner.stdout.strip() and owner.stdout.strip() != "<no value>" else "something other than gb10d"
            raise SpawnError(
                f"a container named {self.name} exists that {whose} started; gb10d leaves it alone: "
                f"remove it ({self.engine.kind} rm -f {self.name}) or set container.name"
            )
        removed: list[str] = []
        for line in listed.stdout.splitlines():
            cid, _, rest = line.partition(" ")
            name, _, status = rest.partition(" ")
            result = await engine_call(self.engine, "rm", "--force", cid, env=env)
            if result.status != 0 and "No such container" not in result.stderr and "no such container" not in result.stderr:
                raise unreachable_error(self.engine, result, "rm")
            removed.append(f"{name} ({cid[:12]}, {status.lower()})")
        if not removed:
            return None
        return f"removed the container {', '.join(removed)} that an earlier gb10d left behind"


async def _read_all(client: ProcessGroup) -> str:
    """What the exited client wrote to stderr (its stdout is drained and dropped)."""
    chunks: list[bytes] = []
    await asyncio.gather(*client.readers(lambda _: None, chunks.append))
    return b"".join(chunks).decode("utf-8", "replace")
