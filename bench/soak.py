"""`python -m bench soak --minutes N --seed S`: the front and three instances under clients and faults for N minutes.

`gb10d front` and three `gb10d run` instances over the stand-in (GB10D_SIM_SPEED 0.03) on one simulated memory (one
meminfo file, one ledger): `embed` (an embedding model, pinned), `alpha` (on demand, park = "stop") and `beta` (on
demand, park = "sleep"); alpha and beta do not fit together beside embed, so requests for both make them swap.
The soak plays systemd: it restarts a gb10d or the front that exits (Restart=), and it holds the front's listening
socket and passes it as fd 3 (LISTEN_FDS=1, LISTEN_PID), as gb10d-front.socket does, so that a killed front's
clients wait in the socket's backlog for the next one.

32 client tasks send streamed and plain completions to alpha and beta and embeddings to embed; a tenth of the
streams disconnect after the first event, a few read slowly. A fault every 10-30 s, drawn from random.Random(seed):

- `kill_api` / `kill_engine`: SIGKILL of vLLM's API server / of its EngineCore, of an instance that serves.
- `stop_engine`: SIGSTOP of the EngineCore, never continued: gb10d's liveness watch must find it hung and restart.
- `reload_restart`: vllm.gpu_memory_utilization changed by 0.01 and SIGHUP to gb10d (vLLM restarts);
  `reload_live`: liveness.progress_timeout_s changed and SIGHUP (vLLM must not restart).
- `kill_gb10d`: SIGKILL of a gb10d and of its vLLM's process group (systemd's cgroup kill; the stand-in's memory
  keeper, the kernel's part, stays), then a new gb10d one second later (Restart=).
- `kill_front`: SIGKILL of the front, a new one half a second later on the same socket.
- `memory_pressure`: MemAvailable lowered in the meminfo file by up to 40 GiB for 15 s.
- `state_unwritable`: an instance's state directory made unwritable for 10 s (chattr +i as root, else mode 0500).
- `ledger_removed`: the ledger directory removed.

After each fault the soak waits until every instance is settled again (pinned serving, on-demand ones serving,
parked or asleep) and then counts ORPHANS (stand-in processes whose group no live gb10d owns, /dev/shm files) and
DISAGREEMENTS (between `gb10d status --json`, the state file, the processes and the front's /v1/models). A request
is LOST when it got no response, a reset with no error event, or no answer within the hold timeout plus 30 s; a
request reset because the front it was in was killed is counted apart (no proxy survives its own SIGKILL). The run
exits 1 when LOST, UNCLEAR (an error without a JSON message), ORPHANS, DISAGREEMENTS or UNRECOVERED is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from gb10d.base.units import GIB
from gb10d.daemon.lab import GB10_TOTAL_GIB, Gb10d, LineReader, clean_env, free_port, kill_group, live_pids, started_groups, write_meminfo
from gb10d.machine.memory import read_meminfo
from gb10d.machine.procs import PROC, rss_kib, stat_fields
from gb10d.machine.statefile import read_state
from gb10d.sim import make_venv
from gb10d.sim.memory import adjust

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
SPEED = "0.03"
CLIENTS = 32
HOLD_TIMEOUT_S = 30.0
LOST_AFTER_S = HOLD_TIMEOUT_S + 30.0
FAULT_GAP_S = (10.0, 30.0)
RECOVERY_S = 120.0
# A view that disagrees must still disagree after this long: states are written a moment after they change.
AGREE_WITHIN_S = 15.0
SETTLED = ("serving", "parked", "asleep")
FAULTS = (
    "kill_api", "kill_engine", "stop_engine", "reload_restart", "reload_live", "kill_gb10d", "kill_front",
    "memory_pressure", "state_unwritable", "ledger_removed",
)
SHM_PREFIXES = ("psm_", "torch_", "vllm")
OWN_LINE = r"^<\d>gb10d(-front)?: "


@dataclass(frozen=True)
class Spec:
    """One instance of the soak: its model, share of the memory and [on_demand] (None: pinned)."""

    name: str
    model: str
    utilization: float
    on_demand: dict[str, Any] | None = None

    @property
    def embeds(self) -> bool:
        return "Embedding" in self.model


# Shares of 121.69 GiB plus 1 GiB headroom: embed 25.3, alpha and beta 49.7 each; 124.7 GiB together, 112 available.
SPECS = (
    Spec("embed", "Qwen/Qwen3-Embedding-8B", 0.2),
    Spec("alpha", "/srv/models/tiny-llama", 0.4, {"park": "stop", "idle_timeout_s": 8.0}),
    Spec("beta", "/srv/models/tiny-llama", 0.4, {"park": "sleep", "idle_timeout_s": 8.0}),
)


def _last_own_line(run: Incarnation) -> str:
    found = run.out.find(OWN_LINE) if run.out is not None else []
    return found[-1][1][:400] if found else "(it wrote nothing)"


def _cause(message: str) -> str:
    """An error message with its numbers blanked, so that the same cause counts once."""
    return re.sub(r"\d+(\.\d+)?", "N", message)[:240]


@dataclass
class Incarnation:
    """One run of a supervised program (a gb10d, the front): when it started, its output, its RSS samples."""

    name: str
    proc: subprocess.Popen[bytes]
    out: LineReader | None
    started_at: float = field(default_factory=time.monotonic)
    killed: bool = False
    rss_warm_kib: int | None = None
    rss_end_kib: int | None = None

    def lines(self) -> int:
        return len(self.out.entries) if self.out is not None else 0

    def own_lines(self) -> int:
        """Lines the program wrote itself, not vLLM's lines it forwarded."""
        return len(self.out.find(OWN_LINE)) if self.out is not None else 0


class Instance:
    """One `gb10d run` and its files, restarted like `Restart=` would when it exits."""

    def __init__(self, spec: Spec, root: Path, venv: Path, meminfo: Path, ledger: Path) -> None:
        self.spec = spec
        self.root = root
        self.config = root / "instances" / f"{spec.name}.toml"
        self.state_dir = root / "run" / spec.name
        self.state_file = self.state_dir / "state.json"
        self.port = free_port()
        self.utilization = spec.utilization
        self.progress_timeout_s = 10.0
        self._venv, self._meminfo, self._ledger = venv, meminfo, ledger
        self.state_dir.mkdir(parents=True)
        self.write_config()
        self.runs: list[Incarnation] = []
        self.gb10d: Gb10d | None = None

    def write_config(self) -> None:
        data: dict[str, Any] = {
            "vllm": {
                "venv": str(self._venv), "model": self.spec.model, "served_model_name": self.spec.name, "host": "127.0.0.1",
                "port": self.port, "gpu_memory_utilization": round(self.utilization, 2), "args": {"max_model_len": 2048},
                "env": {"GB10D_SIM_SPEED": SPEED, "GB10D_SIM_MEMINFO": str(self._meminfo), "SOAK_RUN": str(self.root),
                        "SOAK_INSTANCE": self.spec.name},
            },
            "startup": {"stall_timeout_s": 30.0, "ready_timeout_s": 120.0, "health_poll_interval_s": 0.5},
            "memory": {"meminfo_path": str(self._meminfo), "recovery_timeout_s": 10.0, "ledger_dir": str(self._ledger)},
            "restart": {"max_attempts": 10, "backoff_initial_s": 0.2, "backoff_max_s": 2.0, "reset_after_s": 30.0},
            "liveness": {"health_interval_s": 1.0, "progress_timeout_s": self.progress_timeout_s, "idle_probe_interval_s": 2.0,
                         "probe_timeout_s": 4.0},
            "metrics": {"listen": ""},
            "daemon": {"stop_timeout_s": 5.0, "state_file": str(self.state_file),
                       "learned_file": str(self.root / "lib" / self.spec.name / "state.toml"), "watch_config": False,
                       "kernel_log": "none"},
        }
        if self.spec.on_demand is not None:
            data["on_demand"] = self.spec.on_demand
        partial = self.config.with_name(self.config.name + ".tmp")
        partial.write_text(tomli_w.dumps(data))
        partial.replace(self.config)

    def start(self) -> None:
        self.gb10d = Gb10d(self.config)
        self.runs.append(Incarnation(self.spec.name, self.gb10d.proc, self.gb10d.out))

    @property
    def pid(self) -> int | None:
        return self.gb10d.pid if self.gb10d is not None and self.gb10d.proc.poll() is None else None

    def vllm_group(self) -> int | None:
        """The process group of the vLLM this gb10d started last (None before its first start)."""
        if self.gb10d is None:
            return None
        groups = started_groups(self.gb10d.texts(), "vLLM")
        return groups[-1] if groups else None

    def state(self) -> str | None:
        try:
            record = read_state(self.state_file)
        except OSError:
            return None
        return record.state.value if record is not None and record.state is not None else None

    def kill(self) -> None:
        """SIGKILL gb10d and its vLLM's process group, as systemd's cgroup kill would (the stand-in's keeper stays)."""
        if self.gb10d is None:
            return
        self.runs[-1].killed = True
        kill_group(self.gb10d.pid)
        group = self.vllm_group()
        if group is not None:
            kill_group(group)
        self.gb10d.proc.wait(10)


def _front_command(config: Path, fd: int) -> list[str]:
    """`gb10d front` with the held socket as its fd 3 and sd_listen_fds' variables naming its own pid."""
    script = (
        "import os, sys\n"
        "fd = int(sys.argv[1])\n"
        "if fd != 3:\n    os.dup2(fd, 3)\n    os.close(fd)\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'gb10d', '--config', sys.argv[2], 'front'])\n"
    )
    return [sys.executable, "-c", script, str(fd), str(config)]


@dataclass
class Window:
    """A fault from its injection until everything is settled again."""

    kind: str
    target: str
    start: float
    end: float | None = None


@dataclass
class Figures:
    """What the clients saw and the checks found."""

    sent: int = 0
    ok: int = 0
    aborted: int = 0  # the client's own disconnects
    front_killed: int = 0  # in the front when it was SIGKILLed
    errors: Counter[tuple[int, str, str]] = field(default_factory=Counter)
    lost: list[dict[str, Any]] = field(default_factory=list)
    unclear: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    disagreements: list[dict[str, Any]] = field(default_factory=list)
    unrecovered: list[dict[str, Any]] = field(default_factory=list)
    findings: Counter[str] = field(default_factory=Counter)  # by cause, numbers blanked
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    recovery_s: dict[str, list[float]] = field(default_factory=dict)


class Soak:
    """The machine of one soak: files, the supervised programs, the faults and the checks."""

    def __init__(self, root: Path, seed: int, faults: tuple[str, ...] = FAULTS) -> None:
        self.root = root
        self.kinds = faults
        self.seed = seed
        self.rng = random.Random(seed)  # the faults' own: the clients have theirs
        self.until = 0.0  # when the clients and the faults stop (monotonic); set by run, moved on by fault_loop
        self.venv = root / "venv"
        make_venv(self.venv)
        self.meminfo = write_meminfo(root / "meminfo", GB10_TOTAL_GIB, 110.0)
        self.ledger = root / "ledger"
        self.ledger.mkdir()
        (root / "instances").mkdir()
        self.instances = {spec.name: Instance(spec, root, self.venv, self.meminfo, self.ledger) for spec in SPECS}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sock = socket.create_server(("127.0.0.1", self.port), backlog=4096)
        self.front_config = root / "front.toml"
        settings = {"listen": f"127.0.0.1:{self.port}", "metrics_listen": "", "instances_dir": str(root / "instances"),
                    "hold_timeout_s": HOLD_TIMEOUT_S, "state_file": str(root / "front-state.json")}
        self.front_config.write_text(tomli_w.dumps({"front": settings}))
        self.front_runs: list[Incarnation] = []
        self.figures = Figures()
        self.windows: list[Window] = []
        self.front_kills: list[float] = []
        self.shm_before = self._shm()
        self.lock = threading.Lock()  # the fault windows, read by the clients
        self.supervision = threading.Lock()  # restarts, by the supervisor or by a fault
        self.stopping = threading.Event()

    # --- the programs, as systemd runs them -------------------------------------------------------------

    def start_front(self) -> None:
        proc = subprocess.Popen(_front_command(self.front_config, self.sock.fileno()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=clean_env(), start_new_session=True, pass_fds=(self.sock.fileno(),))
        assert proc.stdout is not None
        self.front_runs.append(Incarnation("front", proc, LineReader(proc.stdout)))

    @property
    def front(self) -> Incarnation:
        return self.front_runs[-1]

    def restart_exited(self) -> None:
        """Restart= (RestartSec 1 s) for what exited without the soak killing it: each such exit is a finding."""
        with self.supervision:
            for instance in self.instances.values():
                run = instance.runs[-1]
                if run.proc.poll() is not None and not run.killed:
                    self.figures.findings[f"gb10d of {instance.spec.name} exited with status {run.proc.returncode}: "
                                          + _cause(_last_own_line(run))] += 1
                    time.sleep(1.0)
                    instance.start()
            if self.front.proc.poll() is not None and not self.front.killed:
                self.figures.findings[f"the front exited with status {self.front.proc.returncode}: " + _cause(_last_own_line(self.front))] += 1
                self.start_front()

    def supervise(self) -> None:
        """systemd's part: restart what exits, until the run ends."""
        while not self.stopping.wait(0.5):
            self.restart_exited()

    def close(self) -> None:
        """SIGTERM everything, as `systemctl stop` does, then SIGKILL whatever is left."""
        runs = [self.front, *(i.runs[-1] for i in self.instances.values())]
        for run in runs:
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        for run in runs:
            try:
                run.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.figures.findings[f"{run.name} did not stop within 30 s of SIGTERM"] += 1
        for instance in self.instances.values():
            if instance.gb10d is not None:
                instance.gb10d.close()
        kill_group(self.front.proc.pid)
        self.sock.close()

    # --- observing ---------------------------------------------------------------------------------------

    def _marked(self) -> list[tuple[int, int, int, str, str]]:
        """(pid, pgid, ppid, comm, instance) of each stand-in process of this soak (SOAK_RUN in its environment)."""
        ours = f"SOAK_RUN={self.root}".encode()
        found = []
        for pid in live_pids(lambda entry, _fields: ours in entry.joinpath("environ").read_bytes().split(b"\0")):
            try:
                entry = PROC / str(pid)
                fields = stat_fields(entry)
                environ = entry.joinpath("environ").read_bytes().split(b"\0")
                name = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"SOAK_INSTANCE=")), "?")
                comm = entry.joinpath("comm").read_text().strip()
                found.append((pid, int(fields[2]), int(fields[1]), comm, name))
            except (OSError, ValueError, IndexError):
                continue
        return found

    def _shm(self) -> set[str]:
        try:
            return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIXES) and p.stat().st_uid == os.getuid()}
        except OSError:
            return set()

    def orphans_now(self) -> list[dict[str, Any]]:
        """Stand-in processes no live gb10d owns (neither in its vLLM's group nor the keeper of an engine in it)."""
        owned = {g for i in self.instances.values() if i.pid is not None and (g := i.vllm_group()) is not None}
        procs = self._marked()
        in_owned = {pid for pid, pgid, _, _, _ in procs if pgid in owned}
        found: list[dict[str, Any]] = [
            {"pid": pid, "pgid": pgid, "comm": comm, "instance": name}
            for pid, pgid, ppid, comm, name in procs if pgid not in owned and ppid not in in_owned
        ]
        found += [{"shm": name} for name in sorted(self._shm() - self.shm_before)]
        return found

    def front_states(self) -> dict[str, str]:
        try:
            listed = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return {m["id"]: str(m["gb10d_state"]) for m in listed}

    def _status(self, instance: Instance) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-m", "gb10d", "--config", str(instance.config), "status", "--json"],
                              capture_output=True, text=True, timeout=60, env=clean_env())
        try:
            return dict(json.loads(done.stdout))
        except ValueError:
            return {"error": done.stdout + done.stderr}

    def disagreement(self, instance: Instance) -> str | None:
        """What the views of one instance disagree on, None when they agree; "" when it changed while being looked at."""
        before = instance.state()
        status = self._status(instance)
        front = self.front_states().get(instance.spec.name, "")
        group = instance.vllm_group()
        members = [p for p in self._marked() if p[4] == instance.spec.name and p[1] == group]
        record = read_state(instance.state_file)
        if before != instance.state() or record is None or record.state is None:
            return ""
        state = record.state.value
        if before not in SETTLED:
            return ""
        if not status.get("running") or status.get("state") != state:
            return f"gb10d status says running={status.get('running')} state={status.get('state')}, the state file {state}"
        if record.pid != instance.pid:
            return f"the state file names gb10d pid {record.pid}, the live gb10d is {instance.pid}"
        if not front.startswith(state):
            return f"the front's /v1/models says {front!r}, the state file {state}"
        running = len(members) >= 2
        if state in ("serving", "asleep") and not (running and record.vllm_pid == group):
            return f"the state file says {state} (vLLM pid {record.vllm_pid}), vLLM's group {group} has {len(members)} processes"
        if state == "parked" and members:
            return f"the state file says parked, vLLM's group {group} still has {len(members)} processes"
        return None

    def settled(self) -> bool:
        if self.front.proc.poll() is not None or any(i.pid is None for i in self.instances.values()):
            return False
        states = {name: i.state() for name, i in self.instances.items()}
        return all(s in SETTLED for s in states.values()) and states["embed"] == "serving"

    def check(self, label: str) -> None:
        """After a fault: wait until settled, then count orphans and disagreements that last."""
        started = time.monotonic()
        while not self.settled():
            if time.monotonic() - started > RECOVERY_S or (self.stopping.is_set() and time.monotonic() - started > 30):
                states = {name: i.state() for name, i in self.instances.items()}
                self.figures.unrecovered.append({"after": label, "states": states})
                return
            time.sleep(0.2)
        self.figures.recovery_s.setdefault(label, []).append(round(time.monotonic() - started, 2))
        self._sample_rss()
        deadline = time.monotonic() + AGREE_WITHIN_S
        orphans = self.orphans_now()
        while orphans and time.monotonic() < deadline:
            time.sleep(0.5)
            orphans = self.orphans_now()
        for orphan in orphans:
            self.figures.orphans.append({"after": label, **orphan})
        for instance in self.instances.values():
            deadline = time.monotonic() + AGREE_WITHIN_S
            while (found := self.disagreement(instance)) and time.monotonic() < deadline:
                time.sleep(0.5)
            if found:
                self.figures.disagreements.append({"after": label, "instance": instance.spec.name, "what": found})

    def _sample_rss(self) -> None:
        for run in [self.front, *(i.runs[-1] for i in self.instances.values())]:
            if run.rss_warm_kib is None and time.monotonic() - run.started_at > 15 and run.proc.poll() is None:
                run.rss_warm_kib = rss_kib(run.proc.pid)

    # --- faults ------------------------------------------------------------------------------------------

    def _serving(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.state() == "serving" and i.vllm_group() is not None]

    def _engine(self, instance: Instance) -> int | None:
        group = instance.vllm_group()
        return next((pid for pid, pgid, _, comm, _ in self._marked() if pgid == group and comm.startswith("VLLM::Engine")), None)

    def inject(self, kind: str) -> str | None:
        """Inject one fault; the instance it hit, or None when it could not be injected now."""
        pick = self.rng.random()  # drawn whatever happens, so that the seed fixes the sequence of faults
        if kind in ("kill_api", "kill_engine", "stop_engine"):
            serving = self._serving()
            if not serving:
                return None
            target = serving[int(pick * len(serving))]
            pid = target.vllm_group() if kind == "kill_api" else self._engine(target)
            if pid is None:
                return None
            os.kill(pid, signal.SIGSTOP if kind == "stop_engine" else signal.SIGKILL)
            return target.spec.name
        target = list(self.instances.values())[int(pick * len(self.instances))]
        if kind in ("reload_restart", "reload_live"):
            pid = target.pid  # read once: the supervising thread replaces a gb10d that exits, meanwhile
            if pid is None:
                return None
            if kind == "reload_restart":
                target.utilization += 0.01 if target.utilization <= target.spec.utilization else -0.01
            else:
                target.progress_timeout_s = 21.0 - target.progress_timeout_s
            group = target.vllm_group()
            target.write_config()
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                return None  # it exited after it was picked: its successor reads the new config at its start
            if kind == "reload_live":
                line = target.gb10d.wait_line(r"reload|config", 20) if target.gb10d is not None else None
                if line is None:
                    self.figures.findings[f"reload_live: gb10d of {target.spec.name} said nothing of the reload within 20 s"] += 1
                elif target.vllm_group() != group:
                    self.figures.findings[f"reload_live: a reload of liveness.progress_timeout_s restarted {target.spec.name}'s vLLM"] += 1
            return target.spec.name
        if kind == "kill_gb10d":
            target.kill()
            time.sleep(1.0)  # RestartSec
            target.start()
            return target.spec.name
        if kind == "kill_front":
            self.front.killed = True
            self.front_kills.append(time.monotonic())
            kill_group(self.front.proc.pid)
            self.front.proc.wait(10)
            time.sleep(0.5)
            self.start_front()
            return "front"
        if kind == "memory_pressure":
            taken = min(40 * GIB, read_meminfo(self.meminfo).available - 2 * GIB) // 1024 * 1024
            if taken <= 0 or adjust(self.meminfo, -taken, need_bytes=taken) is not None:
                return None
            self.stopping.wait(15.0)
            adjust(self.meminfo, taken)
            return f"{taken / GIB:.1f} GiB"
        if kind == "state_unwritable":
            with _unwritable(target.state_dir) as works:
                if not works:
                    return None
                self.stopping.wait(10.0)
            return target.spec.name
        if kind == "ledger_removed":
            shutil.rmtree(self.ledger, ignore_errors=True)
            return "ledger"
        raise ValueError(kind)

    def fault_loop(self, at_least: int) -> None:
        """A fault every 10-30 s until the run's end (`self.until`), each followed by the checks; the end moves on
        until `at_least` faults were injected (a busy machine spends more of the run settling after each)."""
        self.check("warm-up")
        while True:
            gap = self.rng.uniform(*FAULT_GAP_S)
            injected = sum(self.figures.faults.values())
            if injected < at_least and time.monotonic() + gap >= self.until:
                self.until = time.monotonic() + gap + 1.0
            if self.stopping.wait(max(0.0, min(gap, self.until - time.monotonic()))) or time.monotonic() >= self.until:
                return
            kind = self.rng.choice(self.kinds)
            window = Window(kind, "", time.monotonic())
            with self.lock:
                self.windows.append(window)
            # The supervisor must not restart what a fault kills before the fault does.
            with self.supervision if kind in ("kill_gb10d", "kill_front") else contextlib.nullcontext():
                target = self.inject(kind)
            if target is None:
                self.figures.skipped[kind] += 1
                window.end = time.monotonic()
                continue
            window.target = target
            self.figures.faults[kind] += 1
            print(f"soak: {time.monotonic() - self.t0:5.0f} s  {kind} ({target})", file=sys.stderr, flush=True)
            self.check(kind)
            window.end = time.monotonic()

    def fault_during(self, start: float, end: float) -> str:
        """The last fault whose window overlaps [start, end], "none" without one."""
        with self.lock:
            hits = [w.kind for w in self.windows if w.start <= end and (w.end is None or w.end >= start)]
        return hits[-1] if hits else "none"

    # --- clients -----------------------------------------------------------------------------------------

    async def client(self, number: int) -> None:
        rng = random.Random(f"{self.seed}-{number}")
        timeout = httpx.Timeout(LOST_AFTER_S, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as client:
            pooled_since = time.monotonic()
            while time.monotonic() < self.until:
                pooled_since = await self.request(client, rng, pooled_since)
                await asyncio.sleep(rng.uniform(0.1, 1.0))

    async def request(self, client: httpx.AsyncClient, rng: random.Random, pooled_since: float) -> float:
        """One request; returns when it began, the oldest its kept-alive connection can be for the next one."""
        model = rng.choice([s.name for s in SPECS])
        embeds = self.instances[model].spec.embeds
        kind = "embedding" if embeds else rng.choice(("stream", "stream", "plain"))
        disconnect = kind == "stream" and rng.random() < 0.1
        slow = kind == "stream" and not disconnect and rng.random() < 0.1
        self.figures.sent += 1
        start = time.monotonic()
        try:
            outcome = await asyncio.wait_for(self._exchange(client, model, kind, disconnect, slow), LOST_AFTER_S)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            outcome = ("lost", f"no answer within {LOST_AFTER_S:g} s")
        except httpx.HTTPError as exc:
            # In the front when it was killed, or sent on a kept-alive connection to the front that was.
            if any(pooled_since < at < time.monotonic() for at in self.front_kills):
                outcome = ("front_killed", "")
            else:
                outcome = ("lost", f"{type(exc).__name__}: {exc}")
        self._record(outcome, model, kind, start)
        return start

    async def _exchange(self, client: httpx.AsyncClient, model: str, kind: str, disconnect: bool, slow: bool) -> tuple[Any, ...]:
        if kind == "embedding":
            return _answer(await client.post("/v1/embeddings", json={"model": model, "input": "hello"}), "data")
        if kind == "plain":
            return _answer(await client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 8}), "choices")
        body = {"model": model, "prompt": "hello", "max_tokens": 20 if slow else 12, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return _answer(response, "", await response.aread())
            text = ""
            async for chunk in response.aiter_text():
                text += chunk
                if disconnect and "data: " in text:
                    return ("aborted",)
                if slow:
                    await asyncio.sleep(0.3)
        return _stream_outcome(text)

    def _record(self, outcome: tuple[Any, ...], model: str, kind: str, start: float) -> None:
        fault = self.fault_during(start, time.monotonic())
        what = outcome[0]
        if what == "ok":
            self.figures.ok += 1
        elif what == "aborted":
            self.figures.aborted += 1
        elif what == "front_killed":
            self.figures.front_killed += 1
        elif what == "error":
            self.figures.errors[(outcome[1], _cause(outcome[2]), fault)] += 1
        else:
            entry = {"model": model, "kind": kind, "fault": fault, "what": outcome[1], "at_s": round(start - self.t0, 1)}
            (self.figures.lost if what == "lost" else self.figures.unclear).append(entry)

    async def clients(self) -> None:
        await asyncio.gather(*(self.client(n) for n in range(CLIENTS)))

    # --- the run -----------------------------------------------------------------------------------------

    def run(self, minutes: float, at_least: int = 0) -> dict[str, Any]:
        """`minutes` of clients and faults, longer if it takes that to inject `at_least` faults."""
        self.t0 = time.monotonic()
        self.start_front()
        for instance in self.instances.values():
            instance.start()
        self.until = self.t0 + 60 * minutes
        faults = threading.Thread(target=self.fault_loop, args=(at_least,))
        supervisor = threading.Thread(target=self.supervise)
        faults.start()
        supervisor.start()
        try:
            asyncio.run(self.clients())
        finally:
            self.stopping.set()
            faults.join()
            supervisor.join()
        self.check("end")
        for run in [self.front, *(i.runs[-1] for i in self.instances.values())]:
            run.rss_end_kib = rss_kib(run.proc.pid)
        wall = time.monotonic() - self.t0
        self.close()
        for orphan in self.orphans_now():
            self.figures.orphans.append({"after": "stop", **orphan})
        return self.result(wall)

    def write_journals(self, directory: Path) -> None:
        """Each program's output, one file per run: `alpha-2.log` is the second gb10d of alpha."""
        directory.mkdir(parents=True, exist_ok=True)
        for runs in [self.front_runs, *(i.runs for i in self.instances.values())]:
            for number, run in enumerate(runs, 1):
                if run.out is not None:
                    lines = [f"{at - self.t0:8.2f} {line}" for at, line in run.out.entries]
                    (directory / f"{run.name}-{number}.log").write_text("\n".join(lines) + "\n")

    def result(self, wall: float) -> dict[str, Any]:
        f = self.figures
        by_fault: Counter[str] = Counter()
        for (_, _, fault), n in f.errors.items():
            by_fault[fault] += n
        programs: dict[str, Any] = {}
        for name, runs in [("front", self.front_runs), *((n, i.runs) for n, i in self.instances.items())]:
            last = runs[-1]
            programs[name] = {
                "runs": len(runs),
                "journal_lines_per_min": round(sum(r.lines() for r in runs) / (wall / 60), 1),
                "own_lines_per_min": round(sum(r.own_lines() for r in runs) / (wall / 60), 1),
                "rss_warm_mib": None if last.rss_warm_kib is None else round(last.rss_warm_kib / 1024, 1),
                "rss_end_mib": None if last.rss_end_kib is None else round(last.rss_end_kib / 1024, 1),
                "rss_growth": None if not (last.rss_warm_kib and last.rss_end_kib) else round(last.rss_end_kib / last.rss_warm_kib - 1, 3),
            }
        return {
            "wall_s": round(wall, 1), "speed": float(SPEED), "clients": CLIENTS,
            "sent": f.sent, "answered_200": f.ok, "client_disconnects": f.aborted, "reset_by_front_kill": f.front_killed,
            "errors": [{"status": s, "cause": c, "fault": fault, "count": n} for (s, c, fault), n in sorted(f.errors.items(), key=lambda e: -e[1])],
            "errors_by_fault": dict(by_fault),
            "lost": f.lost, "unclear": f.unclear, "orphans": f.orphans, "disagreements": f.disagreements, "unrecovered": f.unrecovered,
            "faults": dict(f.faults), "faults_skipped": dict(f.skipped), "recovery_s": f.recovery_s, "programs": programs,
            "findings": [{"what": what, "count": n} for what, n in f.findings.most_common()],
        }


@contextlib.contextmanager
def _unwritable(directory: Path) -> Any:
    """`directory` unwritable for the block (chattr +i as root, whom a mode does not stop; else mode 0500); yields
    whether it took."""
    root = os.geteuid() == 0
    if root:
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
        if done.returncode != 0:
            yield False
            return
    else:
        directory.chmod(0o500)
    try:
        probe = directory / ".soak-probe"
        try:
            probe.touch()
            probe.unlink()
            yield False
        except OSError:
            yield True
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(directory)], capture_output=True)
        else:
            directory.chmod(0o755)


def _answer(response: httpx.Response, key: str, raw: bytes | None = None) -> tuple[Any, ...]:
    """A whole (not streamed) answer: ok with `key` in its JSON, else an error with its message, else unclear."""
    body = raw if raw is not None else response.content
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if response.status_code == 200 and isinstance(data, dict) and key in data:
        return ("ok",)
    message = data.get("error", {}).get("message") if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
    if message:
        return ("error", response.status_code, str(message))
    return ("unclear", f"status {response.status_code}: {body[:200]!r}")


def _stream_outcome(text: str) -> tuple[Any, ...]:
    """A whole stream: ok when it ends in [DONE], an error when its last event carries one, else lost."""
    events = [e for e in text.split("\n\n") if e.strip() and not e.startswith(":")]
    if events and events[-1].strip() == "data: [DONE]":
        return ("ok",)
    for event in reversed(events):
        payload = event.split("data: ", 1)[-1]
        with contextlib.suppress(ValueError):
            data = json.loads(payload)
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                return ("error", int(data["error"].get("code") or 0), str(data["error"].get("message")))
    return ("lost", f"the stream ended after {len(events)} events without [DONE] or an error event")


MUST_BE_ZERO = ("lost", "unclear", "orphans", "disagreements", "unrecovered")


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Soak of {result['wall_s'] / 60:.1f} min, seed {result['seed']}, {result['clients']} clients, stand-in speed {result['speed']:g}:",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests sent | {result['sent']} |",
        f"| answered 200 | {result['answered_200']} |",
        f"| clear errors | {sum(e['count'] for e in result['errors'])} |",
        f"| client disconnects (on purpose) | {result['client_disconnects']} |",
        f"| reset by the front's SIGKILL | {result['reset_by_front_kill']} |",
        *(f"| **{name.upper()}** (must be 0) | {len(result[name])} |" for name in MUST_BE_ZERO),
        f"| faults | {', '.join(f'{k} {v}' for k, v in sorted(result['faults'].items()))} |",
        f"| skipped (could not be injected then) | {', '.join(f'{k} {v}' for k, v in sorted(result['faults_skipped'].items())) or '-'} |",
        "",
        "| status | cause | fault | count |",
        "|---|---|---|---|",
        *(f"| {e['status']} | {e['cause']} | {e['fault']} | {e['count']} |" for e in result["errors"]),
        "",
        "| program | runs | journal lines/min (its own) | RSS after warm-up (MiB) | RSS at the end (MiB) | growth |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in result["programs"].items():
        growth = "-" if p["rss_growth"] is None else f"{p['rss_growth']:+.1%}"
        lines.append(f"| {name} | {p['runs']} | {p['journal_lines_per_min']} ({p['own_lines_per_min']}) | {p['rss_warm_mib']} | {p['rss_end_mib']} | {growth} |")
    for name in MUST_BE_ZERO:
        for entry in result[name][:20]:
            lines.append(f"{name.upper()}: {json.dumps(entry)}")
    for finding in result["findings"]:
        lines.append(f"FINDING ({finding['count']}x): {finding['what']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients and faults run (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of the faults and the clients' choices (default 1)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="the kinds of fault to draw from, comma-separated (default: all)")
    parser.add_argument("--faults-at-least", type=int, default=0, metavar="N", help="go on past --minutes until N faults were injected (default 0)")
    parser.add_argument("--journals", type=Path, help="write every program's output there, one file per run of it")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write the JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    kinds = tuple(args.faults.split(","))
    if unknown := set(kinds) - set(FAULTS):
        parser.error(f"--faults: no such kind {', '.join(sorted(unknown))}; the kinds are {', '.join(FAULTS)}")
    root = Path(tempfile.mkdtemp(prefix="gb10d-soak-"))
    try:
        soak = Soak(root, args.seed, kinds)
        try:
            result = {"seed": args.seed, "minutes": args.minutes, **soak.run(args.minutes, args.faults_at_least)}
        except BaseException:
            soak.close()
            raise
        finally:
            if args.journals is not None:
                soak.write_journals(args.journals)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    failed = [name for name in MUST_BE_ZERO if result[name]]
    for name in failed:
        print(f"soak: {name.upper()} is {len(result[name])}, must be 0", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
