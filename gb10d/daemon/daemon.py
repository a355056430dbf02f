"""`gb10d run`: the daemon assembled from its parts, and what every run does before and after them.

The parts are small objects with one job each: the fact loop (`loop`),
the reporter (`reporter`), the config keeper (`keeper`), the checks around
a start (`preflight`), how vLLM runs (`runtime`: a local process group, or
a container through docker or podman, picked here by `EngineChoice`), this
machine's part in a pair (`pair`), and the two kinds of daemon: the
`Supervisor`, which runs vLLM, and the `WorkerDaemon` of a pair's second
machine, which runs only Ray. This module wires them together, and gives every run the same frame:
signals and the watchdog, the metrics listener, the config watcher, the
GPU device check, a give-up reported the same way everywhere, and nothing
left running afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

from ..base.command import Engine
from ..base.config import Config
from ..base.errors import GiveUp
from ..base.instance import holds
from ..base.levels import PRIORITY_ERR, PRIORITY_WARNING
from ..core.facts import Edited
from ..core.reload import ConfigSnapshot
from ..launch.container import ContainerLauncher
from ..launch.engine import choose_engine
from ..launch.process import become_subreaper
from ..launch.runtime import Launcher, LocalLauncher
from ..machine.journal import DEFAULT_SOCKET_PATH, Journal, connected_to_journal
from ..machine.kernellog import KernelLog
from ..machine.ledger import Booking, instance_name, open_booking
from ..machine.notify import Notifier
from ..vllm import sleepmode
from .control import ControlSocket
from .keeper import ConfigKeeper
from .loop import FactLoop
from .metrics import Metrics
from .pair import Pair
from .preflight import Preflight
from .reporter import STATUS_MAX, Reporter
from .supervisor import Supervisor
from .worker import WorkerDaemon

# How often a running instance checks that its record in the memory ledger is still there (Booking.keep).
LEDGER_KEEP_S = 5.0


class EngineChoice:
    """How vLLM runs for a config: a local process group, or a container through the engine chosen once.

    `container.engine = "auto"` asks which engine answers; the answer holds
    until a reload changes the engine or its socket, so every start of a
    run uses the same engine. An engine that cannot be reached is a GiveUp
    with what to do about it.
    """

    def __init__(self, config_path: Path) -> None:
        # The container's label names the config absolutely, as `gb10d cleanup` and print-command name it.
        self._config_path = config_path.absolute()
        self._chosen: tuple[object, Engine] | None = None

    async def __call__(self, config: Config) -> Launcher:
        if config.vllm.image is None:
            return LocalLauncher()
        asked = (config.container.engine, config.container.socket)
        if self._chosen is None or self._chosen[0] != asked:
            # The engine's client answers in milliseconds, or within ENGINE_TIMEOUT_S when its daemon hangs.
            engine, problem = await asyncio.to_thread(choose_engine, config.container)
            if problem is not None:
                raise GiveUp(str(problem), problem.exit_status)
            self._chosen = (asked, engine)
        return ContainerLauncher(config, self._config_path, self._chosen[1])


async def serve(path: Path, snapshot: ConfigSnapshot, journal: Journal, notifier: Notifier, metrics: Metrics) -> int:
    """Run the daemon the config asks for until it stops (0) or gives up (its exit status).

    Its parts close in the reverse order of their making: vLLM (the supervisor) first, Ray after it, the memory
    ledger's record once both are gone, the reporter last, with every line said.
    """
    config = snapshot.config
    reporter = Reporter(config, journal, notifier, metrics)
    async with contextlib.AsyncExitStack() as parts:
        parts.callback(reporter.close)
        try:
            # First, before the state file or the metrics port is touched: they may be another living instance's.
            booking = open_booking(
                config.memory.ledger_path, instance_name(path), str(path),
                lambda text: reporter.say("memory_ledger", text, PRIORITY_WARNING), holds(config, path),
            )
        except GiveUp as exc:
            reporter.say("gave_up", exc.reason, PRIORITY_ERR, exit_status=exc.exit_status)
            notifier.status(f"failed: {exc.reason}"[:STATUS_MAX])
            return exc.exit_status
        if booking is not None:
            parts.callback(booking.close)
        keeper = ConfigKeeper(path, snapshot, reporter)
        loop = FactLoop(notifier)
        pair = Pair(keeper, reporter, loop) if config.cluster is not None else None
        preflight = Preflight(keeper, reporter)
        kernel = KernelLog(config.daemon.kernel_log, loop.post, lambda text: reporter.say("kernel_log", text, PRIORITY_WARNING))
        loop.install()
        parts.push_async_callback(loop.remove)
        if pair is not None:
            parts.push_async_callback(pair.close)
        reporter.serve_metrics()
        keeper.watch(asyncio.get_running_loop(), lambda: loop.post(Edited()))
        parts.callback(keeper.close)
        kernel.start()
        parts.push_async_callback(kernel.close)
        try:
            preflight.gpu()
            host = preflight.host()
            if pair is not None and pair.cluster.role == "worker":
                return await WorkerDaemon(keeper, reporter, loop, pair).serve()
            # vLLM runs here: its share of the machine's memory is booked in the ledger the instances share.
            reporter.ledger.booked(booking)
            preflight.booking = booking
            if booking is not None:
                parts.callback(asyncio.create_task(_keep_booked(booking)).cancel)
            # Every instance listens: the front parks and wakes an on-demand one, and its page may restart any.
            control = ControlSocket(sleepmode.control_path(config.daemon.state_file), loop.post, on_demand=config.on_demand is not None)
            parts.push_async_callback(control.close)
            try:
                await control.start()
            except OSError as exc:
                if config.on_demand is not None:
                    raise  # the front could never wake it: as before, no start without its socket
                reporter.say(
                    "control_socket_unavailable",
                    f"cannot listen on {control.path} ({exc.strerror or exc}): the front's page cannot restart this instance "
                    "(systemctl restart can); serving without it",
                    PRIORITY_WARNING,
                )
            supervisor = Supervisor(keeper, reporter, loop, preflight, EngineChoice(path), pair, host)
            parts.push_async_callback(supervisor.close)
            return await supervisor.supervise()
        except GiveUp as exc:
            reporter.gave_up(exc.reason, exc.exit_status, exc.told)
            return exc.exit_status


async def _keep_booked(booking: Booking) -> None:
    """A removed ledger record (its directory removed under the running instances) is written again within
    LEDGER_KEEP_S, even while nothing else makes this instance touch the ledger (serving for days)."""
    while True:
        await asyncio.sleep(LEDGER_KEEP_S)
        booking.keep()


def run_daemon(config_path: Path, config: Config) -> int:
    """Supervise with `config`, as read from `config_path` (re-read from it on each reload); the body of `gb10d run`.

    The command line has already loaded and checked the config (the service user's reach included): it is not
    parsed a second time here.
    """
    snapshot = ConfigSnapshot.take(config)
    journal = Journal(sys.stdout, socket_path=DEFAULT_SOCKET_PATH if connected_to_journal(sys.stdout) else None)
    notifier = Notifier(on_error=lambda message: journal.event("watchdog", message, PRIORITY_ERR))
    become_subreaper()
    return asyncio.run(serve(config_path, snapshot, journal, notifier, Metrics()))
