"""`gb10d demo`: the real supervisor against gb10d.sim, in a temporary directory.

It shows a newcomer what systemd and the journal would see when gb10d
recovers from a GB10 failure, on any Linux laptop: `gb10d run` is started
as a child with a real NOTIFY_SOCKET, its journal lines and the sd_notify
datagrams are printed as they arrive, one request is sent once it is
ready, and SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import tomli_w

GIB_KB = 1024 * 1024


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_files(root: Path, scenario: Scenario, speed: float) -> tuple[Path, int]:
    from .sim import make_venv

    venv = root / "venv"
    make_venv(venv)
    meminfo = root / "meminfo"
    total = 121.69
    meminfo.write_text(
        f"MemTotal: {int(total * GIB_KB)} kB\nMemFree: {int(scenario.free_gib * GIB_KB)} kB\n"
        f"MemAvailable: {int((scenario.free_gib + 1) * GIB_KB)} kB\nCached: {GIB_KB} kB\n"
    )
    ledger = root / "ledger"
    ledger.mkdir()
    port = _free_port()
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


async def _show(name: str, scenario: Scenario, speed: float, verbose: bool, out: TextIO) -> int:
    with tempfile.TemporaryDirectory(prefix="gb10d-demo-") as tmp:
        root = Path(tmp)
        config, port = _write_files(root, scenario, speed)
        notify_path = str(root / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(notify_path)
        sock.setblocking(False)
        out.write(f"gb10d demo: {name}\n{scenario.description}\n\n")
        out.write("Lines starting 'journal |' are gb10d's own journal lines; 'systemd <-' are its sd_notify messages.\n\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
        env["NOTIFY_SOCKET"] = notify_path
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gb10d", "run", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        start = time.monotonic()

        def on_datagram() -> None:
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    return
                text = data.decode("latin-1").replace("\n", " ")
                out.write(f"{time.monotonic() - start:7.2f}s systemd <- {text}\n")
                if "READY=1" in text:
                    ready.set()

        loop.add_reader(sock.fileno(), on_datagram)

        hidden = 0

        async def journal() -> None:
            nonlocal hidden
            assert process.stdout is not None
            async for raw in process.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                if verbose or line[3:].startswith("gb10d: "):
                    out.write(f"{time.monotonic() - start:7.2f}s journal | {line}\n")
                else:
                    hidden += 1

        reader = asyncio.create_task(journal())
        waiter = asyncio.create_task(process.wait())
        await asyncio.wait({asyncio.create_task(ready.wait()), waiter}, return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "Qwen3.6-27B-FP8-Agent", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                )
            out.write(f"\nA client request to the served name answers HTTP {answer.status_code}.\n")
            out.write("Sending SIGTERM to gb10d, as `systemctl stop gb10d` would.\n\n")
            process.send_signal(signal.SIGTERM)
        status = await waiter
        await reader
        loop.remove_reader(sock.fileno())
        sock.close()
        out.write(f"\ngb10d exited with status {status}.")
        if hidden:
            out.write(f" {hidden} lines vLLM printed were forwarded too (shown with --verbose).")
        out.write("\n")
        return 0 if ready.is_set() and status == 0 else 1


def run_demo(name: str, speed: float, verbose: bool = False, out: TextIO = sys.stdout) -> int:
    """Run one named demo scenario; returns 0 when it reached READY and stopped cleanly."""
    return asyncio.run(_show(name, SCENARIOS[name], speed, verbose, out))
