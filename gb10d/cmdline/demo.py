"""`gb10d demo`: the real supervisor against gb10d.sim, in a temporary directory.

It shows a newcomer what systemd and the journal would see when gb10d
recovers from a GB10 failure, on any Linux laptop: `gb10d run` is started
as a child with a real NOTIFY_SOCKET, its journal lines and the sd_notify
datagrams are printed as they arrive, one request is sent once it is
ready, and SIGTERM stops it. The parts are gb10d.daemon.lab's, the ones the tests
and benchmarks watch gb10d with.
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import tomli_w

from ..base.errors import Gb10dError
from ..daemon.lab import GB10_TOTAL_GIB, Gb10d, NotifyReceiver, carries, free_port, write_meminfo
from ..daemon.learnedfile import load as load_learned

_PRIORITY = re.compile(r"^<[0-7]>")


@dataclass(frozen=True)
class Scenario:
    """One demo: what the sim does, the memory it reports, and what gb10d is configured with."""

    description: str
    sim_scenario: str
    free_gib: float
    utilization: float
    preflight: bool
    shards: int = 6


SCENARIOS = {
    "free-memory": Scenario(
        "vLLM refuses to start: only 103.45 GiB of 121.69 GiB are free (the page cache counts as used on GB10) "
        "and the config asks for 0.92. gb10d reads the numbers from the error and restarts once with a value that fits.",
        "healthy", 103.45, 0.92, preflight=False,
    ),
    "preflight": Scenario(
        "The same shortage, but with memory.preflight on: gb10d reads /proc/meminfo first and starts vLLM once, already fitting.",
        "healthy", 103.45, 0.92, preflight=True,
    ),
    "stall": Scenario(
        "Shard loading freezes at 0/66 (the GB10 mmap stall). gb10d notices no progress and no I/O for "
        "startup.stall_timeout_s, kills the process group and restarts with --safetensors-load-strategy eager.",
        "stall_at=0", 110.0, 0.8, preflight=True, shards=66,
    ),
    "healthy": Scenario("A healthy start: phases in STATUS=, READY=1 once vLLM really serves.", "healthy", 110.0, 0.8, preflight=True),
}


def _write_files(root: Path, scenario: Scenario, speed: float) -> tuple[Path, int]:
    from ..sim import make_venv

    venv = root / "venv"
    make_venv(venv)
    meminfo = write_meminfo(root / "meminfo", GB10_TOTAL_GIB, scenario.free_gib, cached_gib=1.0)
    ledger = root / "ledger"
    ledger.mkdir()
    port = free_port()
    config: dict[str, Any] = {
        "vllm": {
            "venv": str(venv),
            "model": "Qwen/Qwen3.6-27B-FP8",
            "served_model_name": "Qwen3.6-27B-FP8-Agent",
            "host": "127.0.0.1",
            "port": port,
            "gpu_memory_utilization": scenario.utilization,
            "args": {"max_model_len": 131072, "enable_prefix_caching": True},
            "env": {
                "GB10D_SIM_SCENARIO": scenario.sim_scenario,
                "GB10D_SIM_SPEED": str(speed),
                "GB10D_SIM_MEMINFO": str(meminfo),
                "GB10D_SIM_SHARDS": str(scenario.shards),
            },
        },
        "startup": {"stall_timeout_s": 5.0},
        # Its own ledger: the demo's simulated machine is not this one.
        "memory": {"meminfo_path": str(meminfo), "preflight": scenario.preflight, "ledger_dir": str(ledger)},
        "metrics": {"listen": ""},
        "daemon": {"state_file": str(root / "state.json"), "learned_file": str(root / "learned.toml"), "watch_config": False},
    }
    path = root / "gb10d.toml"
    path.write_text(tomli_w.dumps(config))
    return path, port


class _Screen:
    """What the demo prints as it happens: datagrams and gb10d's own lines, each with its time since the start.

    Datagrams and lines arrive on two threads, the demo speaks on a third: a lock keeps each printed line whole.
    """

    def __init__(self, out: TextIO, verbose: bool) -> None:
        self._out = out
        self._verbose = verbose
        self._lock = threading.Lock()
        self.start = time.monotonic()
        self.hidden = 0

    def write(self, text: str) -> None:
        """The demo's own words, unstamped."""
        with self._lock:
            self._out.write(text)

    def _stamped(self, text: str) -> None:
        self.write(f"{time.monotonic() - self.start:7.2f}s {text}\n")

    def datagram(self, fields: dict[str, str]) -> None:
        self._stamped("systemd <- " + " ".join(f"{key}={value}" for key, value in fields.items()))

    def line(self, line: str) -> None:
        """gb10d's own lines are shown; vLLM's forwarded ones only counted, unless verbose.

        The `<6>` in front of each line is the priority journald reads from a
        service's stdout; a reader of the demo is not journald, so it is left out.
        """
        line = _PRIORITY.sub("", line.rstrip(), count=1)
        if self._verbose or line.startswith("gb10d: "):
            self._stamped(f"journal | {line}")
        else:
            self.hidden += 1


def _show(name: str, scenario: Scenario, speed: float, verbose: bool, out: TextIO, keep: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="gb10d-demo-") as tmp:
        root = keep or Path(tmp)
        config, port = _write_files(root, scenario, speed)
        screen = _Screen(out, verbose)
        ready = threading.Event()
        settled = threading.Event()  # READY=1 arrived, or gb10d exited without it

        def on_message(fields: dict[str, str]) -> None:
            screen.datagram(fields)
            if carries("READY", "1")(fields):
                ready.set()
                settled.set()

        with NotifyReceiver(root, on_message=on_message) as notify:
            screen.write(f"gb10d demo: {name}\n{scenario.description}\n\n")
            screen.write("Lines starting 'journal |' are gb10d's own journal lines; 'systemd <-' are its sd_notify messages.\n\n")
            with Gb10d(config, notify, on_line=screen.line) as gb10d:

                def settle_at_exit() -> None:
                    gb10d.proc.wait()
                    settled.set()

                threading.Thread(target=settle_at_exit, daemon=True).start()
                settled.wait()
                if ready.is_set():
                    answer = httpx.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json={"model": "Qwen3.6-27B-FP8-Agent", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                        timeout=30,
                    )
                    screen.write(f"\nA client request to the served name answers HTTP {answer.status_code}.\n")
                    screen.write("Sending SIGTERM to gb10d, as `systemctl stop gb10d` would.\n\n")
                    gb10d.terminate()
                status = gb10d.wait_exit(None)
        # Leaving both blocks read every line and datagram gb10d sent: nothing more is printed after this.
        out.write(f"\ngb10d exited with status {status}.")
        if screen.hidden:
            out.write(f" {screen.hidden} lines vLLM printed were forwarded too (shown with --verbose).")
        out.write("\n" + _kept(root / "learned.toml", config if keep is not None else None))
        if keep is not None:
            out.write(
                f"\nThe simulated machine stays in {keep}: run gb10d on it yourself with\n"
                f"    gb10d run --config {config}\n"
                f"and watch it with gb10d status --config {config} (Ctrl-C stops it, as systemctl stop would).\n"
            )
        return 0 if ready.is_set() and status == 0 else 1


def _kept(learned: Path, config: Path | None) -> str:
    """What gb10d learned and kept for its next start, in a sentence; "" when the first start needed no correction.

    With `config` (the files stay) the sentence names the file and how to undo it.
    """
    entry = load_learned(learned).entry
    if entry is None or entry.gpu_memory_utilization is None:
        return ""
    where = f"in {learned}" if config else "in its learned file (daemon.learned_file)"
    undo = f" (gb10d forget --config {config} undoes that)" if config else ""
    return f"gb10d kept the value that worked, gpu_memory_utilization {entry.gpu_memory_utilization:g}, {where}: its next start begins with it{undo}.\n"


def prepare_keep(directory: Path) -> Path:
    """The directory `--keep` leaves the demo's files in: new or empty, never one with the operator's files in it."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise Gb10dError(f"{directory} is not an empty directory; name a new one for gb10d demo --keep")
    directory.mkdir(parents=True, exist_ok=True)
    return directory.resolve()


def run_demo(name: str, speed: float, verbose: bool = False, out: TextIO = sys.stdout, keep: Path | None = None) -> int:
    """Run one named demo scenario, its files in `keep` if given; returns 0 when it reached READY and stopped cleanly."""
    return _show(name, SCENARIOS[name], speed, verbose, out, prepare_keep(keep) if keep is not None else None)
