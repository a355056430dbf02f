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

Decisions are plain functions at the top (what an engine's error means, what
the cgroup files say); the classes below only run the engine.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import pwd
import re
import shutil
import signal
import struct
import subprocess
import termios
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable, Mapping, Sequence

from ..base.command import CONTAINER_LABEL, PODMAN_SOCKET, Engine, EngineKind, build_env, container_argv, container_name, engine_client, inherited_env
from ..base.config import Config, ContainerSection, VllmSection
from ..base.configload import LoadedConfig
from ..base.errors import EXIT_CONFIG, EXIT_GAVE_UP, ConfigProblem, SpawnError
from ..base.image import ImageInfo, PreparedImage, PullProgress, PullState, advance_pull, image_info, not_present, pull_failure, pull_lines
from .process import ChunkHandler, ProcessGroup
from .runtime import Escalation

# An engine that does not answer a simple request within this long is as good as unreachable.
ENGINE_TIMEOUT_S = 30.0
# How long a started container may take to have a process (GPU hooks and a cold storage driver take seconds).
START_TIMEOUT_S = 60.0
# A pull's output is kept up to this size for the failure message.
_PULL_OUTPUT_CAP = 1 << 16
ProgressHandler = Callable[[PullProgress], None]


class EngineUnavailable(SpawnError):
    """The container engine cannot be reached, or refused to run the container."""

    def __init__(self, message: str, exit_status: int = EXIT_CONFIG) -> None:
        # 78 when the operator must change something (a permission, a package, the GPU toolkit);
        # 75 when the engine may come back by itself (its daemon not started yet, or hung).
        self.exit_status = exit_status
        super().__init__(message)


# --- what the engine's words mean -------------------------------------------------------------------


def unreachable_advice(engine: Engine, text: str, user: str) -> str | None:
    """What to do when the engine's client says it cannot reach the engine; None when the text says something else.

    Only failures on the engine's own socket count: a registry that refuses
    a connection is a pull failure, not an engine that is down.
    """
    socket = re.search(r"dial unix (/\S+?):|unix://(/\S+?)[.:]?(?:\s|$)", text)
    if socket is None and "Cannot connect to the Docker daemon" not in text and "Cannot connect to Podman" not in text:
        return None
    path = (socket.group(1) or socket.group(2)) if socket else ("/var/run/docker.sock" if engine.kind == "docker" else str(PODMAN_SOCKET))
    if "permission denied" in text:
        if engine.kind == "docker":
            return (
                f"the user {user} may not use docker's socket {path}; add it to the docker group "
                f"(sudo usermod -aG docker {user}, then restart gb10d). Membership of the docker group is as good as root on this machine"
            )
        return (
            f"the user {user} may not use podman's socket {path}; let its group in (sudo systemctl edit podman.socket: "
            f"[Socket] SocketGroup={user}, then sudo systemctl restart podman.socket). Access to the socket is as good as root on this machine"
        )
    if engine.kind == "docker":
        return f"docker's daemon is not running (nothing answers on {path}); start it: sudo systemctl enable --now docker"
    return f"podman's API service is not running (nothing answers on {path}); start it: sudo systemctl enable --now podman.socket"


def unreachable_status(text: str) -> int:
    """The exit status for an engine that cannot be reached: 75 when its daemon is not running (it may yet start), else 78."""
    if "permission denied" in text:
        return EXIT_CONFIG
    return EXIT_GAVE_UP


def run_failure(engine: Engine, image: str, text: str, status: int) -> str:
    """Why `ENGINE run` could not start the container, and what to do, from the client's stderr."""
    said = next((line.strip() for line in text.splitlines() if re.search(r"error", line, re.I)), text.strip().splitlines()[0] if text.strip() else f"exit status {status}")
    said = re.sub(r"^(?:docker|podman):\s*", "", said)
    tool = engine.kind
    if "could not select device driver" in text and "gpu" in text:
        advice = ("docker cannot give the container the GPU: install the NVIDIA Container Toolkit and register it "
                  "(sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker), or set container.gpu = \"cdi\"")
    elif "could not select device driver \"cdi\"" in text or "unresolvable CDI devices" in text:
        advice = ("there is no CDI description of the GPU: sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml "
                  "(again after every driver update)")
    elif "executable file not found" in text:
        advice = f"the image {image} has no vllm program on its PATH; is it a vLLM image?"
    elif "No such image" in text or "image not known" in text:
        advice = f"the image {image} is not present; set container.pull = \"missing\" or load it ({tool} pull {image})"
    elif "already in use" in text:
        advice = f"another container has the name gb10d wants; remove it ({tool} rm -f NAME) or set container.name"
    elif "rlimit" in text:
        advice = f"{tool} may not set the container's resource limits here; give them in container.run_args (--ulimit NAME=SOFT:HARD)"
    else:
        advice = f"try the command by hand: gb10d print-command (it prints the exact {tool} run)"
    return f"{tool} could not start the container of {image}: {said}; {advice}"


def signal_status(status: int) -> int:
    """A container's exit status as gb10d reports a process's: 128+N (as engines and init report a signal) is -N."""
    if 128 < status < 128 + 65:
        try:
            return -signal.Signals(status - 128)
        except ValueError:
            return status
    return status


# --- the container's cgroup ---------------------------------------------------------------------------


def cgroup_mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """Where each cgroup hierarchy is mounted, and the cgroup path at its root, from /proc/self/mountinfo.

    Keys are v1 controller names (`blkio`, `memory`, ...) and `unified` for
    the v2 hierarchy (all of /sys/fs/cgroup on cgroup v2, /sys/fs/cgroup/unified
    on a hybrid host).
    """
    mounts: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        root, point = fields[3], Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            mounts.setdefault("unified", (point, root))
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("blkio", "memory", "pids", "cpu", "cpuacct") or option.startswith("name="):
                    mounts.setdefault(option, (point, root))
    return mounts


def cgroup_dir(proc_cgroup: str, mounts: Mapping[str, tuple[Path, str]], hierarchy: str) -> Path | None:
    """The directory of a process's cgroup in one hierarchy (`unified`, `blkio`, `memory`); None when not visible here."""
    if hierarchy not in mounts:
        return None
    point, root = mounts[hierarchy]
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "unified" and number == "0" and controllers == "") or hierarchy in controllers.split(","):
            relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
            if relative.startswith(".."):
                return None  # outside the part of the tree this mount shows (another cgroup namespace)
            return point / relative if relative != "." else point
    return None


def io_stat_bytes(text: str) -> int:
    """Bytes read and written, summed over devices, from cgroup v2 `io.stat`."""
    total = 0
    for line in text.splitlines():
        for field in line.split()[1:]:
            name, _, value = field.partition("=")
            if name in ("rbytes", "wbytes") and value.isdigit():
                total += int(value)
    return total


def blkio_bytes(text: str) -> int:
    """Bytes read and written from cgroup v1 `blkio.throttle.io_service_bytes` (the per-device Read and Write lines)."""
    total = 0
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in ("Read", "Write") and fields[2].isdigit():
            total += int(fields[2])
    return total


def paged_in_bytes(memory_stat: str, page_size: int) -> int:
    """Bytes of pages brought into the container's memory cgroup (v1 `memory.stat` total_pgpgin, else pgpgin)."""
    values = dict(line.split()[:2] for line in memory_stat.splitlines() if len(line.split()) >= 2)
    pages = values.get("total_pgpgin") or values.get("pgpgin") or "0"
    return int(pages) * page_size if pages.isdigit() else 0


@dataclass(frozen=True)
class ContainerCgroup:
    """The cgroup files of a running container, as this machine mounts them.

    cgroup v2 counts block I/O per cgroup in io.stat. cgroup v1's blkio
    counts it only for devices with a throttle limit on recent kernels, so
    on v1 the pages the container's memory cgroup took in (a file read from
    disk, an mmap fault, new memory) count as well: a loader that reads moves
    that count, a hung one does not.
    """

    procs_dir: Path
    io_stat: Path | None = None
    blkio: Path | None = None
    memory_stat: Path | None = None

    @classmethod
    def of(cls, pid: int, container_id: str) -> ContainerCgroup | None:
        """The cgroup of the container `container_id` whose process is `pid` on the engine's host; None when it cannot be seen from here.

        The engine names a pid of its own host's pid namespace. Where gb10d
        runs in another one (a booted container that reaches the host's
        engine through its socket), the same number is some other process
        or none: only a cgroup that names the container's id is its own.
        """
        try:
            proc_cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        except OSError:
            return None
        if not container_id or container_id not in proc_cgroup:
            return None
        return cgroup_files(proc_cgroup, mounts)

    def io_bytes(self) -> int | None:
        """The I/O count of the container so far; None when no file of it can be read (the container is gone)."""
        page = os.sysconf("SC_PAGE_SIZE")
        readings: list[int] = []
        for path, parse in ((self.io_stat, io_stat_bytes), (self.blkio, blkio_bytes), (self.memory_stat, lambda t: paged_in_bytes(t, page))):
            if path is None:
                continue
            try:
                readings.append(parse(path.read_text()))
            except OSError:
                continue
        return sum(readings) if readings else None

    def procs(self) -> list[int]:
        """The pids of the container's processes (host pids), empty once it is gone."""
        try:
            return [int(pid) for pid in (self.procs_dir / "cgroup.procs").read_text().split()]
        except OSError:
            return []


def cgroup_files(proc_cgroup: str, mounts: Mapping[str, tuple[Path, str]]) -> ContainerCgroup | None:
    """Which files count a process's cgroup: io.stat on cgroup v2, blkio and memory.stat where v1 controllers are mounted."""
    blkio, memory = cgroup_dir(proc_cgroup, mounts, "blkio"), cgroup_dir(proc_cgroup, mounts, "memory")
    if blkio is None and memory is None:
        unified = cgroup_dir(proc_cgroup, mounts, "unified")
        return ContainerCgroup(unified, io_stat=unified / "io.stat") if unified is not None else None
    return ContainerCgroup(
        memory or blkio,  # type: ignore[arg-type]  # one of them is set
        blkio=blkio / "blkio.throttle.io_service_bytes_recursive" if blkio is not None else None,
        memory_stat=memory / "memory.stat" if memory is not None else None,
    )


# --- running the engine's client -----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineResult:
    """What one engine command printed, and its exit status."""

    status: int
    stdout: str
    stderr: str


def _user() -> str:
    """The name of the user gb10d runs as, for advice such as `usermod -aG docker gb10d`."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _unreachable(engine: Engine, result: EngineResult, what: str) -> EngineUnavailable:
    text = result.stderr.strip() or result.stdout.strip()
    advice = unreachable_advice(engine, text, _user())
    last = text.splitlines()[-1] if text else f"exit status {result.status}"
    status = unreachable_status(text) if advice is not None else EXIT_CONFIG
    return EngineUnavailable(f"{engine.kind} {what} failed: {last}" + (f"; {advice}" if advice else ""), status)


async def engine_call(engine: Engine, *args: str, env: Mapping[str, str] | None = None, timeout_s: float | None = ENGINE_TIMEOUT_S) -> EngineResult:
    """Run one engine command (`docker container inspect ...`) with a deadline (None: `wait` for as long as it takes); EngineUnavailable if it cannot run or hangs."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *engine.client, *args,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None, start_new_session=True,
        )
    except FileNotFoundError:
        raise EngineUnavailable(_not_installed(engine)) from None
    except OSError as exc:
        raise EngineUnavailable(f"cannot run {engine.client[0]}: {exc.strerror or exc}") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise EngineUnavailable(
            f"{engine.kind} {' '.join(args[:2])} did not answer within {timeout_s:g} s; is the {engine.kind} daemon hung? ({engine.kind} info)", EXIT_GAVE_UP
        ) from None
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        raise
    return EngineResult(proc.returncode or 0, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _not_installed(engine: Engine) -> str:
    package = "docker.io (or Docker's docker-ce)" if engine.kind == "docker" else "podman"
    other = "podman" if engine.kind == "docker" else "docker"
    return f"{engine.client[0]} is not installed: sudo apt install {package}, or set container.engine = \"{other}\""


def probe(engine: Engine, env: Mapping[str, str] | None = None) -> EngineUnavailable | None:
    """Whether the engine answers (synchronous); None when it does, else what to do about it."""
    args = ["version", "--format", "{{.Server.Version}}"] if engine.kind == "docker" else ["info", "--format", "{{.Version.Version}}"]
    try:
        done = subprocess.run([*engine.client, *args], capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return EngineUnavailable(_not_installed(engine))
    except subprocess.TimeoutExpired:
        return EngineUnavailable(f"{engine.kind} did not answer within {ENGINE_TIMEOUT_S:g} s; is its daemon hung? ({engine.kind} info)", EXIT_GAVE_UP)
    if done.returncode == 0:
        return None
    return _unreachable(engine, EngineResult(done.returncode, done.stdout, done.stderr), "info" if engine.kind == "podman" else "version")


def _missing_socket(container: ContainerSection) -> EngineUnavailable | None:
    """A configured socket that is not there: the config's mistake (78), not an engine that may yet come up."""
    socket = container.socket
    if socket is None:
        return None
    try:
        os.stat(socket)
        return None
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError:
        return None  # not ours to look at (a 0700 /run/podman): the engine's client says what it finds
    return EngineUnavailable(
        f"there is no socket {socket}: no engine can answer there; set container.socket to the engine's API socket "
        f"(docker: /var/run/docker.sock, podman: {PODMAN_SOCKET}), or remove it to use the engine's default"
    )


def choose_engine(container: ContainerSection, env: Mapping[str, str] | None = None) -> tuple[Engine, EngineUnavailable | None]:
    """The engine to use and, when it cannot be reached, what to do about it.

    `auto` takes docker when its daemon answers, else podman when it
    answers; when neither does, docker with both engines' problems.
    """
    as_root = os.geteuid() == 0
    missing = _missing_socket(container)
    if missing is not None:
        return engine_client("docker" if container.engine == "auto" else container.engine, container.socket, as_root), missing
    if container.engine != "auto":
        engine = engine_client(container.engine, container.socket, as_root)
        return engine, probe(engine, env)
    problems: list[EngineUnavailable] = []
    kinds: tuple[EngineKind, ...] = ("docker", "podman")
    for kind in kinds:
        engine = engine_client(kind, container.socket, as_root)
        problem = probe(engine, env)
        if problem is None:
            return engine, None
        problems.append(problem)
    # Only when both may still come up is it worth systemd's starting gb10d again later.
    status = EXIT_GAVE_UP if all(p.exit_status == EXIT_GAVE_UP for p in problems) else EXIT_CONFIG
    text = "neither docker nor podman can be reached: " + "; ".join(str(p) for p in problems)
    return engine_client("docker", container.socket, as_root), EngineUnavailable(text, status)


def engine_problems(loaded: LoadedConfig) -> tuple[Engine, list[ConfigProblem]]:
    """check-config's container checks: the engine answers, a `never`-pulled image is there, a CDI GPU is described."""
    config = loaded.config
    assert config.vllm.image is not None
    engine, problem = choose_engine(config.container)
    # The line to fix: the socket when one is set and the client is installed, else the engine, else the image.
    on_socket = config.container.socket is not None and shutil.which(engine.client[0]) is not None
    keys = [key for key in ("container.socket" if on_socket else "", "container.engine") if key and loaded.location_of(key)]
    where = keys[0] if keys else "vllm.image"
    if problem is not None:
        return engine, [loaded.problem(where, str(problem))]
    problems: list[ConfigProblem] = []
    if config.container.pull == "never":
        found = subprocess.run([*engine.client, "image", "inspect", config.vllm.image], capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if found.returncode != 0:
            problems.append(loaded.problem("container.pull", str(not_present(engine.kind, config.vllm.image))))
    uses_cdi = config.container.gpu == "cdi" or (config.container.gpu == "auto" and engine.kind == "podman")
    if uses_cdi and not any(Path(d, "nvidia.yaml").exists() or Path(d, "nvidia.json").exists() for d in ("/etc/cdi", "/var/run/cdi")):
        problems.append(loaded.problem(
            "container.gpu",
            f"{engine.kind} gives the GPU through CDI, but there is no /etc/cdi/nvidia.yaml or /var/run/cdi/nvidia.yaml: "
            "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml (again after every driver update), "
            'or set container.gpu = "none" to run without the GPU',
        ))
    return engine, problems


# --- images ------------------------------------------------------------------------------------------


async def inspect_image(engine: Engine, reference: str, env: Mapping[str, str] | None = None) -> ImageInfo | None:
    """The local image `reference` names, or None when it is not present."""
    result = await engine_call(engine, "image", "inspect", reference, env=env)
    if result.status != 0:
        if re.search(r"No such image|image not known|failed to find image", result.stderr, re.I):
            return None
        raise _unreachable(engine, result, "image inspect")
    found = json.loads(result.stdout)[0]
    return image_info(reference, str(found.get("Id", "")), list(found.get("RepoDigests") or []), found.get("Digest"))


async def pull(engine: Engine, reference: str, on_progress: ProgressHandler, env: Mapping[str, str] | None = None) -> None:
    """`ENGINE pull reference`, reporting a PullProgress each time the pull moves; PullFailed when it fails.

    The client writes to a pseudo-terminal: only there do docker and podman
    print byte counts, and without them a 10 GB layer would be minutes of
    silence that look like a stall. Cancelling the task stops the pull.
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    try:
        proc = await asyncio.create_subprocess_exec(
            *engine.client, "pull", reference,
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=dict(env) if env is not None else None, start_new_session=True,
        )
    except FileNotFoundError:
        os.close(master)
        raise EngineUnavailable(_not_installed(engine)) from None
    finally:
        os.close(slave)
    state = PullState(reference)
    on_progress(state.progress())
    output: list[str] = []
    size = 0
    partial = ""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        nonlocal state, partial, size
        try:
            chunk = os.read(master, 1 << 16).decode("utf-8", "replace")
        except OSError:  # EIO: the client closed the terminal
            chunk = ""
        if not chunk:
            loop.remove_reader(master)
            if not ended.done():
                ended.set_result(None)
            return
        if size < _PULL_OUTPUT_CAP:
            output.append(chunk)
            size += len(chunk)
        text = partial + chunk
        cut = max(text.rfind("\r"), text.rfind("\n"))
        partial = text[cut + 1 :]
        for line in pull_lines(text[: cut + 1]):
            after = advance_pull(state, line)
            if after is not state:
                state = after
                on_progress(state.progress())

    loop.add_reader(master, readable)
    try:
        await ended
        status = await proc.wait()
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        await proc.wait()
        raise
    finally:
        loop.remove_reader(master)
        os.close(master)
    if status != 0:
        text = "".join(output) + partial
        advice = unreachable_advice(engine, text, _user())
        if advice is not None:
            raise EngineUnavailable(f"{engine.kind} pull failed: {pull_lines(text)[-1]}; {advice}")
        raise pull_failure(engine.kind, reference, text, status)


async def prepare_image(engine: Engine, reference: str, policy: str, on_progress: ProgressHandler, env: Mapping[str, str] | None = None) -> PreparedImage:
    """The image to start, pulled as `container.pull` says; its identity, and the one the tag named before a pull."""
    before = await inspect_image(engine, reference, env)
    if policy == "never" or (policy == "missing" and before is not None):
        if before is None:
            raise not_present(engine.kind, reference)
        return PreparedImage(before, pulled=False, previous=None)
    await pull(engine, reference, on_progress, env)
    after = await inspect_image(engine, reference, env)
    if after is None:
        raise pull_failure(engine.kind, reference, f"{engine.kind} pull succeeded but the image {reference} is not present afterwards", 0)
    return PreparedImage(after, pulled=True, previous=before)


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
        """`rm -f` the container, then wait for the client to exit; True when neither is left."""
        await self._tell("rm", "--force", self.name)
        if self._client.alive():
            try:
                await asyncio.wait_for(self._client.wait(), ENGINE_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._client.kill()
        gone = await self._tell("container", "inspect", "--format", "{{.Id}}", self.name)
        self._removed = gone is not None and gone.status != 0
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
        if status in (125, 126, 127) and (started.status != 0 or started.stdout.startswith("0001-01-01")):
            # The engine refused before vLLM ran: its reason is all the client printed.
            stderr = await _read_all(client)
            await engine_call(self.engine, "rm", "--force", self.name, env=client_env)
            advice = unreachable_advice(self.engine, stderr, _user())
            last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {status}"
            raise EngineUnavailable(f"{self.engine.kind} run failed: {last}; {advice}" if advice else run_failure(self.engine, self.image, stderr, status))
        return runtime  # vLLM ran and exited at once: its output and status tell why

    async def _container_pid(self, client: ProcessGroup, env: Mapping[str, str]) -> tuple[int, str] | None:
        """The host pid of the container's first process once it runs, and the container's id; None when the client exited first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        pause = 0.05
        exited = asyncio.ensure_future(client.wait())
        try:
            while loop.time() < deadline:
                result = await engine_call(self.engine, "container", "inspect", "--format", "{{.State.Running}} {{.State.Pid}} {{.Id}}", self.name, env=env)
                running, pid, cid = (result.stdout.split() + ["", "", ""])[:3]  # docker shows a pid already while it creates the container
                if result.status == 0 and running == "true" and pid.isdigit() and int(pid) > 0:
                    return int(pid), cid
                # Until the engine has created it, wait for the client to exit or a moment to pass.
                done, _ = await asyncio.wait({exited}, timeout=pause)
                if done:
                    return None
                pause = min(pause * 2, 0.5)
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
            raise _unreachable(self.engine, listed, "ps")
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
                raise _unreachable(self.engine, result, "rm")
            removed.append(f"{name} ({cid[:12]}, {status.lower()})")
        if not removed:
            return None
        return f"removed the container {', '.join(removed)} that an earlier gb10d left behind"


async def _read_all(client: ProcessGroup) -> str:
    """What the exited client wrote to stderr (its stdout is drained and dropped)."""
    chunks: list[bytes] = []
    await asyncio.gather(*client.readers(lambda _: None, chunks.append))
    return b"".join(chunks).decode("utf-8", "replace")
