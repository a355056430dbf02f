"""The shell of gb10d in one process, in milliseconds: a scripted vLLM behind the Runtime interface, and a fake clock.

The Supervisor, ConfigKeeper, Preflight, Reporter, LocalLauncher, Journal,
Notifier, metrics and memory ledger are gb10d's own, unchanged. Only what
lies outside gb10d is stood in for: vLLM (a `ScriptedVllm` behind the
`Runtime` interface, which prints recorded vLLM output from the corpus,
answers the API on a real loopback port while it serves, and exits as told
or as the stop ladder makes it) and time. The clock is virtual: whenever the
event loop has nothing to do but wait for a timer, time jumps to that timer,
so a stall timeout or a back-off passes at once, in the order real time
would pass it. sd_notify goes to a real AF_UNIX datagram socket, read back
as systemd would; the config, meminfo and ledger are real files.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import selectors
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Sequence, TypeVar

import pytest

from gb10d.base.config import Config
from gb10d.base.configload import load_config
from gb10d.base.errors import GiveUp
from gb10d.base.instance import holds
from gb10d.base.levels import PRIORITY_WARNING
from gb10d.core.cluster import Node, View
from gb10d.core.facts import Reload, Stop
from gb10d.core.reload import ConfigSnapshot
from gb10d.daemon.keeper import ConfigKeeper
from gb10d.daemon.loop import FactLoop
from gb10d.daemon.metrics import Metrics
from gb10d.daemon.pair import Pair
from gb10d.daemon.preflight import Preflight
from gb10d.daemon.reporter import Reporter
from gb10d.daemon.supervisor import Supervisor
from gb10d.launch.process import ChunkHandler
from gb10d.launch.raynode import RayNode
from gb10d.launch.runtime import Escalation, Launcher, LocalLauncher, Runtime
from gb10d.machine.journal import Journal
from gb10d.machine.ledger import Booking, instance_name, open_booking
from gb10d.machine.notify import Notifier
from harness import Setup

CORPUS = Path(__file__).parent / "corpus"
# Virtual seconds between two lines of a script: vLLM prints in bursts, but never all at once.
LINE_GAP_S = 0.01
# No scenario takes this long in virtual time; past it, a test has hung on something that never comes.
VIRTUAL_LIMIT_S = 3600.0
# How far past a timer the clock jumps: gb10d compares `now >= deadline` on floats that the loop's own
# `now + delay` may round an ulp short of, and a clock that stops there would wake the same waiter forever.
TIMER_OVERSHOOT_S = 1e-6

T = TypeVar("T")


def corpus(name: str) -> list[str]:
    """The lines of one recorded start from the corpus (vLLM 0.31, plain)."""
    return (CORPUS / f"{name}__0.31__plain.log").read_text().splitlines()


def _shutdown(line: str) -> bool:
    """A line of the engine core's shutdown (its steps and the EngineDeadError it leaves the API server with)."""
    return "[shutdown]" in line or " ERROR " in line


def healthy_start() -> list[str]:
    """A recorded healthy start, up to `Application startup complete.`: what vLLM prints before it serves."""
    lines: list[str] = []
    for line in corpus("sim-healthy"):
        if not _shutdown(line):
            lines.append(line)
        if "Application startup complete." in line:
            return lines
    raise AssertionError("the healthy recording has no 'Application startup complete.'")


def engine_death() -> list[str]:
    """What the API server prints when its engine core dies under it (from the same recording)."""
    return [line for line in corpus("sim-healthy") if _shutdown(line)]


# --- the clock ---------------------------------------------------------------------------------------


class VirtualClock:
    """time.monotonic() for gb10d and the event loop alike; moves only when the loop would otherwise sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _VirtualSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait for a timer advances the clock instead of the wall.

    Work in a thread (a DNS lookup of the HTTP client) is waited for in real
    time, with the clock held, so no timer fires while the thread works.
    """

    def __init__(self, clock: VirtualClock, busy: Callable[[], bool]) -> None:
        super().__init__()
        self._clock = clock
        self._busy = busy

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready or timeout == 0:
            return ready
        if self._busy() or timeout is None:
            return super().select(0.05)
        self._clock.now += timeout + TIMER_OVERSHOOT_S
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._in_threads = 0
        super().__init__(_VirtualSelector(clock, lambda: self._in_threads > 0))

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        self._in_threads += 1
        future = super().run_in_executor(executor, func, *args)
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any] | Future[Any]) -> None:
        self._in_threads -= 1


def run_virtual(monkeypatch: pytest.MonkeyPatch, main: Callable[[VirtualClock], Coroutine[Any, Any, T]]) -> T:
    """Run `main` on a virtual-time loop; gb10d's own time.monotonic() reads the same clock."""
    clock = VirtualClock()
    monkeypatch.setattr(time, "monotonic", clock)
    loop = VirtualTimeLoop(clock)
    try:
        return loop.run_until_complete(asyncio.wait_for(main(clock), VIRTUAL_LIMIT_S))
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


# --- systemd's side of sd_notify -----------------------------------------------------------------------


class NotifyListener:
    """A real AF_UNIX datagram socket, as systemd's NOTIFY_SOCKET; read on the loop as messages arrive."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.sock.fileno(), self._drain)

    def _drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self._drain()
        loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def statuses(self) -> list[str]:
        return [m["STATUS"] for m in self.messages if "STATUS" in m]

    def count(self, key: str, value: str | None = None) -> int:
        return sum(1 for m in self.messages if key in m and (value is None or m[key] == value))


# --- vLLM, scripted ------------------------------------------------------------------------------------


@dataclass
class Script:
    """One start of vLLM: the lines it prints, then how it ends.

    `then` is "serve" (answer the API until stopped), "hang" (print nothing
    more and do no I/O until killed), or an exit status. A vLLM that serves
    for `dies_after_s` then prints `last_words` and exits with status 1.
    """

    lines: list[str]
    then: str | int = "serve"
    io_bytes: int | None = 0  # what /proc/PID/io would say: a constant is no I/O
    gaps: Mapping[int, float] = field(default_factory=dict)  # virtual seconds before line i, where not LINE_GAP_S
    dies_after_s: float | None = None
    last_words: list[str] = field(default_factory=list)


class FakeApi:
    """vLLM's OpenAI server on a real loopback port, answering what gb10d's probes ask."""

    def __init__(self, port: int, names: Sequence[str]) -> None:
        self.port = port
        self.names = list(names)
        self._server: asyncio.Server | None = None

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                body = self._answer(method.decode(), path.decode())
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, method: str, target: str) -> bytes:
        path = target.split("?", 1)[0]  # gb10d marks its own requests with a query
        if path == "/v1/models":
            return json.dumps({"object": "list", "data": [{"id": name, "object": "model"} for name in self.names]}).encode()
        if path == "/v1/completions":
            return json.dumps({"choices": [{"text": "!", "index": 0}]}).encode()
        if path == "/metrics":
            return b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        return b"{}"


class ScriptedVllm:
    """A `Runtime` whose output, API and exit follow a `Script`; it obeys the stop ladder as vLLM does."""

    def __init__(self, pid: int, script: Script, api: FakeApi) -> None:
        self._pid = pid
        self.script = script
        self.api = api
        self.signals: list[str] = []
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._err: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._term = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def label(self) -> str:
        return f"pid {self._pid}"

    @property
    def reaches(self) -> str:
        return "its process group"

    async def _run(self) -> None:
        for i, line in enumerate(self.script.lines):
            await asyncio.sleep(self.script.gaps.get(i, LINE_GAP_S))
            self._err.put_nowait(line.encode() + b"\n")
            if line.endswith("Started server process [%d]" % self._pid) or "Application startup complete." in line:
                await self.api.listen()
        then = self.script.then
        if then == "serve" and self.api._server is None:
            await self.api.listen()
        if isinstance(then, int):
            self._end(then)
            return
        if then == "serve" and self.script.dies_after_s is not None:
            try:
                await asyncio.wait_for(self._term.wait(), self.script.dies_after_s)
            except asyncio.TimeoutError:
                await self.api.close()  # the port closes with the engine, a moment before the process exits
                for line in self.script.last_words:
                    self._err.put_nowait(line.encode() + b"\n")
                self._end(1)
                return
        await self._term.wait()
        if then == "serve":
            self._end(-15)  # vLLM exits on SIGTERM; "hang" waits for SIGKILL

    def _end(self, status: int) -> None:
        if not self._exit.done():
            for queue in (self._out, self._err):
                queue.put_nowait(None)
            self._exit.set_result(status)

    def readers(self, on_stdout: ChunkHandler, on_stderr: ChunkHandler) -> list[Awaitable[None]]:
        async def read(queue: asyncio.Queue[bytes | None], handle: ChunkHandler) -> None:
            while (chunk := await queue.get()) is not None:
                handle(chunk)

        return [read(self._out, on_stdout), read(self._err, on_stderr)]

    async def wait(self) -> int:
        status = await asyncio.shield(self._exit)
        await self.api.close()
        return status

    def alive(self) -> bool:
        return not self._exit.done()

    async def stop(self, grace_s: float, on_escalate: Escalation | None = None) -> bool:
        if not self.alive():
            return True
        self.signals.append("SIGTERM")
        self._term.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._exit), grace_s)
        except asyncio.TimeoutError:
            if on_escalate is not None:
                on_escalate([self._pid])
            return await self.kill()
        return True

    async def kill(self, on_escalate: Escalation | None = None) -> bool:
        if self.alive():
            self.signals.append("SIGKILL")
            self._task.cancel()
            self._end(-9)
        await asyncio.gather(self._task, return_exceptions=True)
        return True

    def io_bytes(self) -> int | None:
        return self.script.io_bytes

    def members(self) -> list[int]:
        return [self._pid] if self.alive() else []


def served_names(argv: Sequence[str]) -> list[str]:
    """The names vLLM serves for its command line: those after --served-model-name, else the model."""
    if "--served-model-name" not in argv:
        return [argv[2]]
    rest = argv[argv.index("--served-model-name") + 1 :]
    return list(itertools.takewhile(lambda word: not word.startswith("--"), rest))


class ScriptedLauncher(LocalLauncher):
    """gb10d's `LocalLauncher` (its environment, command line, no image, no leftovers), whose `launch` starts a
    scripted vLLM instead of a process group: the scripts in order, the last repeating.

    Each vLLM serves the names and the port its command line gives, as vLLM does.
    """

    def __init__(self, scripts: Sequence[Script]) -> None:
        self.scripts = list(scripts)
        self.argvs: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.started: list[ScriptedVllm] = []

    async def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> Runtime:
        script = self.scripts[min(len(self.argvs), len(self.scripts) - 1)]
        self.argvs.append(list(argv))
        self.envs.append(dict(env))
        api = FakeApi(int(argv[argv.index("--port") + 1]), served_names(argv))
        vllm = ScriptedVllm(4242 + len(self.argvs), script, api)
        self.started.append(vllm)
        return vllm


# --- Ray, scripted --------------------------------------------------------------------------------------


class ScriptedRay(RayNode):
    """This machine's Ray as a pair's head sees it: no `ray start`, no watcher; the test says what the node table shows."""

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def table(self, view: View) -> None:
        """The watcher reads a new node table from Ray's GCS."""
        self._report(view)


def node(ip: str, head: bool = False, alive: bool = True, death: str = "") -> Node:
    """One machine of the pair's node table, with its GPU."""
    return Node(f"node-{ip}", ip, alive, head, 1.0, death)


# --- the daemon in one process ---------------------------------------------------------------------------


@dataclass
class Shell:
    """gb10d's own shell objects around a scripted vLLM, and what the world sees of them."""

    setup: Setup
    launcher: ScriptedLauncher
    notify: NotifyListener
    out: io.StringIO
    reporter: Reporter
    keeper: ConfigKeeper
    loop: FactLoop
    supervisor: Supervisor
    clock: VirtualClock
    task: asyncio.Task[int] = field(init=False)

    @property
    def config(self) -> Config:
        return self.keeper.config

    def lines(self) -> list[str]:
        """The journal as journald would keep it from stdout: vLLM's lines and gb10d's decisions."""
        return self.out.getvalue().splitlines()

    def own(self) -> list[str]:
        return [line for line in self.lines() if re.match(r"^<\d>gb10d: ", line)]

    def said(self, pattern: str) -> list[str]:
        return [line for line in self.own() if re.search(pattern, line)]

    @property
    def ray(self) -> ScriptedRay:
        """The pair's Ray, once the head has found its link and started it."""
        assert self.supervisor.pair is not None and isinstance(self.supervisor.pair.ray, ScriptedRay)
        return self.supervisor.pair.ray

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of gb10d's /metrics exposition."""
        value = self.reporter.metrics.registry.get_sample_value(name, labels)
        return float(value) if value is not None else None

    async def until(self, predicate: Callable[[], bool], what: str, within_s: float = 600.0) -> None:
        """Let the daemon run (in virtual time) until `predicate` holds; fails after `within_s` virtual seconds."""
        deadline = self.clock.now + within_s
        while not predicate():
            if self.task.done():
                raise AssertionError(f"gb10d ended ({self.task.result()}) before {what}:\n" + "\n".join(self.own()))
            if self.clock.now > deadline:
                raise AssertionError(f"not {what} within {within_s} virtual s:\n" + "\n".join(self.own()))
            await asyncio.sleep(0.05)

    async def ready(self, count: int = 1) -> None:
        await self.until(lambda: self.notify.count("READY", "1") >= count, f"READY=1 #{count}")

    def stop(self, signame: str = "SIGTERM") -> None:
        self.loop.post(Stop(signame))

    def reload(self, **extra: Any) -> None:
        """Edit the config as an operator would, then `systemctl reload` (SIGHUP)."""
        self.setup.extra.update(extra)
        self.setup.write_config()
        self.hup()

    def hup(self) -> None:
        """`systemctl reload gb10d`: what gb10d's SIGHUP handler posts."""
        self.loop.post(Reload())

    async def exit_status(self, within_s: float = 600.0) -> int:
        await self.until(self.task.done, "gb10d exited", within_s)
        return self.task.result()


async def start_shell(setup: Setup, scripts: Sequence[Script], clock: VirtualClock) -> Shell:
    """Assemble the daemon as `gb10d run` does (less the signal handlers and the GPU check) and start supervising."""
    notify = NotifyListener(setup.root / "notify.sock")
    notify.attach(asyncio.get_running_loop())
    snapshot = ConfigSnapshot.take(load_config(setup.config))
    out = io.StringIO()
    journal = Journal(out, socket_path=None)
    notifier = Notifier(socket_path=notify.path)
    reporter = Reporter(snapshot.config, journal, notifier, Metrics())
    keeper = ConfigKeeper(setup.config, snapshot, reporter)
    loop = FactLoop(notifier)
    preflight = Preflight(keeper, reporter)
    launcher = ScriptedLauncher(scripts)

    async def launchers(config: Config) -> Launcher:
        return launcher

    # The machine's memory ledger, shared by the instances of a test as by the gb10d of one machine.
    booking = open_booking(
        snapshot.config.memory.ledger_path, instance_name(setup.config), str(setup.config),
        lambda text: reporter.say("memory_ledger", text, PRIORITY_WARNING), holds(snapshot.config, setup.config),
    )
    reporter.ledger.booked(booking)
    preflight.booking = booking
    pair = Pair(keeper, reporter, loop, ScriptedRay) if snapshot.config.cluster is not None else None
    supervisor = Supervisor(keeper, reporter, loop, preflight, launchers, pair)
    shell = Shell(setup, launcher, notify, out, reporter, keeper, loop, supervisor, clock)
    shell.task = asyncio.create_task(_supervising(supervisor, reporter, booking))
    return shell


async def _supervising(supervisor: Supervisor, reporter: Reporter, booking: Booking | None) -> int:
    """The exit status of `gb10d run`: a give-up is told as `serve` tells it, and on the way out vLLM is
    gone and the ledger's record given back before the exit, as the other instances see it."""
    try:
        return await supervisor.supervise()
    except GiveUp as exc:
        reporter.gave_up(exc.reason, exc.exit_status, exc.told)
        return exc.exit_status
    finally:
        await supervisor.close()
        if supervisor.pair is not None:
            await supervisor.pair.close()
        if booking is not None:
            booking.close()


async def finish(shell: Shell) -> None:
    """What `gb10d run` does after supervising: nothing of vLLM or of its tasks is left."""
    if not shell.task.done():
        shell.stop()
        await asyncio.gather(shell.task, return_exceptions=True)
    shell.keeper.close()
    shell.reporter.close()
    shell.notify.close(asyncio.get_running_loop())
