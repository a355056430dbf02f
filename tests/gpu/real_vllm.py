"""gb10d supervising a real vLLM on a GPU machine: the six checks of the real-vLLM issue in one run.

Run by tests/gpu/run-real-vllm.sh on a machine with an NVIDIA GPU and vLLM
importable (not part of CI). It starts `gb10d run` with a real NOTIFY_SOCKET,
provokes each failure for real, and writes `report.json` and `report.md`
plus the raw outputs to the output directory. Every step records what it
saw even when a later one fails, so a partial run still reports honestly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import tomli_w

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gb10d.core.phases import advance, start  # noqa: E402
from gb10d.daemon.lab import Gb10d, LineReader  # noqa: E402
from gb10d.launch.process import group_alive, group_members  # noqa: E402
from gb10d.vllm.events import Failure  # noqa: E402
from gb10d.vllm.logparse import Classifier, EventScanner, Kind, LineFramer  # noqa: E402
from harness import NotifySocket, wait_until  # noqa: E402


class Journal:
    """A child's stdout (gb10d.daemon.lab's reader), each line stamped on arrival with the same clock as the notify socket."""

    def __init__(self, reader: LineReader) -> None:
        self._reader = reader
        self.lines = reader.lines

    def wait(self, pattern: str, timeout: float, after: int = 0) -> tuple[int, float, re.Match[str]]:
        """(index, arrival time, match) of the first line from index `after` on matching `pattern`."""
        found = self._reader.wait_line(pattern, timeout, after)
        if found is None or not (m := re.search(pattern, found.item)):
            raise TimeoutError(f"no journal line matching {pattern!r} within {timeout} s (or before the output ended)")
        return found.position, found.at, m


def gpu_processes() -> list[dict[str, str]]:
    """What nvidia-smi lists as compute processes (pid, name, used memory)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout
    except FileNotFoundError:
        return []
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            rows.append({"pid": parts[0], "name": parts[1], "used_memory": parts[2]})
    return rows


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def replay(stdout: Path, stderr: Path) -> dict[str, Any]:
    """gb10d's parser over one start's complete real output: line kinds, events, phases, failures."""
    kinds: dict[str, int] = {}
    events: list[str] = []
    failures: list[str] = []
    phases: list[str] = []
    state = start(0.0)
    lines = 0
    for path in (stdout, stderr):
        framer, classifier, scanner = LineFramer(), Classifier(), EventScanner()
        for line in framer.feed(path.read_bytes()) + framer.flush():
            lines += 1
            record = classifier.classify(line.text)
            kinds[record.kind.value] = kinds.get(record.kind.value, 0) + 1
            for event in scanner.feed(line.text):
                events.append(type(event).__name__)
                if isinstance(event, Failure):
                    failures.append(f"{type(event).__name__}: {event}")
                state = advance(state, event, 0.0)
                if not phases or phases[-1] != state.phase.value:
                    phases.append(state.phase.value)
    return {"lines": lines, "kinds": kinds, "event_counts": {e: events.count(e) for e in sorted(set(events))},
            "failures": failures, "phases": phases, "unclassified": kinds.get(Kind.RAW.value, 0)}



VLLM_PROGRAM = "python3 -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv[0]=\"vllm\"; sys.exit(main())'"
PORT = 8000


def driver_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments every driver takes: the model, where results go, and the program behind `vllm`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--program", default=VLLM_PROGRAM, help="what the vllm wrapper execs (a dry run points it at gb10d.sim)")
    return parser


class Run:
    """One driver run: its report, `gb10d run` under a real notify socket, the starts it made, and the kept outputs.

    Every step records what it saw as it goes, so a run cut short by a
    failed step still leaves an honest report.
    """

    def __init__(self, out: Path, work_name: str) -> None:
        self.out = out
        self.raw_dir = out / "raw"
        self.raw_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(os.environ.get("HOME", "/tmp")) / work_name
        self.work.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {"checks": {}, "timeline": []}
        self.t0 = time.monotonic()
        self.groups: list[int] = []

    def note(self, what: str, **facts: Any) -> None:
        self.report["timeline"].append({"t": round(time.monotonic() - self.t0, 3), "what": what, **facts})
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2))
        print(f"[{time.monotonic() - self.t0:7.1f}s] {what} {facts if facts else ''}", flush=True)

    def write_config(self, model: str, program: str, utilization: float, args: dict[str, Any], env: dict[str, str]) -> Path:
        """A `vllm` wrapper keeping each start's own stdout and stderr for the replay, and the config that runs it."""
        wrapper = self.work / "vllm"
        wrapper.write_text(
            "#!/bin/bash\n"
            f'n=$(date +%s%N); exec > >(tee "{self.raw_dir}/$n.stdout") 2> >(tee "{self.raw_dir}/$n.stderr" >&2)\n'
            f'exec {program} "$@"\n'
        )
        wrapper.chmod(0o755)
        return self.write_program_config({"executable": str(wrapper)}, model, utilization, args, env)

    def write_program_config(
        self, program: dict[str, str], model: str, utilization: float, args: dict[str, Any], env: dict[str, str]
    ) -> Path:
        """The config running `program` (its [vllm] key: `executable` or `venv`), rewritten in place on each call."""
        config = self.work / "gb10d.toml"
        config.write_text(tomli_w.dumps({
            "vllm": {
                **program, "model": model, "served_model_name": "tiny", "host": "127.0.0.1", "port": PORT,
                "gpu_memory_utilization": utilization, "args": args, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0", **env},
            },
            "startup": {"stall_timeout_s": 180.0, "ready_timeout_s": 600.0},
            # Host /proc/meminfo says nothing about a discrete GPU's own memory: only vLLM's error can.
            "memory": {"preflight": False, "recovery_timeout_s": 30.0, "min_gpu_memory_utilization": 0.1},
            "restart": {"max_attempts": 4, "backoff_initial_s": 1.0, "backoff_max_s": 5.0},
            "liveness": {"health_interval_s": 1.0},
            "metrics": {"listen": "127.0.0.1:9400"},
            "daemon": {"state_file": str(self.work / "state.json"), "learned_file": str(self.work / "learned.toml"), "watch_config": False},
        }))
        return config

    def start_gb10d(self, config: Path) -> None:
        self.notify = NotifySocket()
        self.gb10d = Gb10d(config, self.notify, env={"PYTHONUNBUFFERED": "1"})
        assert self.gb10d.out is not None
        self.daemon = self.gb10d.proc
        self.journal = Journal(self.gb10d.out)

    def started(self, after: int, timeout: float) -> tuple[int, int]:
        """The journal index and pid of the next vLLM start after line `after`."""
        index, _, m = self.journal.wait(r"gb10d: started vLLM as pid (\d+)", timeout, after + 1)
        self.groups.append(int(m.group(1)))
        return index, int(m.group(1))

    def ready(self, count: int, timeout: float) -> None:
        """Until READY=1 came `count` times; gb10d exiting first fails the step."""
        wait_until(lambda: self.notify.count("READY", "1") >= count or self.daemon.poll() is not None, timeout, f"READY=1 number {count}")
        assert self.daemon.poll() is None, f"gb10d exited with status {self.daemon.returncode}"

    def finish(self) -> None:
        """Nothing of gb10d or its vLLM starts outlives the run; the sd_notify messages and the journal are kept."""
        self.gb10d.close()
        notify_log = [{"t": round(stamp - self.t0, 3), **m} for stamp, m in self.notify.messages]
        (self.out / "notify.json").write_text(json.dumps(notify_log, indent=1))
        (self.out / "journal.txt").write_text("\n".join(f"{stamp - self.t0:9.3f} {line}" for stamp, line in self.journal.lines))
        self.notify.close()

    def replay_starts(self) -> dict[str, Any]:
        """The parser over every start's complete output; then the outputs go into raw.tar.gz."""
        replays = {}
        for stdout in sorted(self.raw_dir.glob("*.stdout")):
            stderr = stdout.with_suffix(".stderr")
            if stderr.exists():
                replays[stdout.stem] = replay(stdout, stderr)
        return replays

    def pack_starts(self) -> None:
        with tarfile.open(self.out / "raw.tar.gz", "w:gz") as tar:
            tar.add(self.raw_dir, arcname="raw")
        for f in self.raw_dir.iterdir():
            f.unlink()
        self.raw_dir.rmdir()


def main() -> int:
    parser = driver_arguments(__doc__ or "")
    parser.add_argument("--hold-gib", type=float, default=100.0)
    args = parser.parse_args()
    run = Run(args.out, "gb10d-real")
    note, report = run.note, run.report
    config = run.write_config(args.model, args.program, 0.9, {"max_model_len": 2048}, {})

    hog = subprocess.Popen(
        [sys.executable, "-c", f"import torch,time; x=torch.empty(int({args.hold_gib}*2**30),dtype=torch.uint8,device='cuda'); print('held',flush=True); time.sleep(3600)"]
        if args.hold_gib > 0 else [sys.executable, "-c", "import time; print('held', flush=True); time.sleep(3600)"],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    assert hog.stdout is not None
    hog.stdout.readline()
    note("another process holds GPU memory", gib=args.hold_gib, gpu=gpu_processes())

    run.start_gb10d(config)
    notify, journal, daemon = run.notify, run.journal, run.daemon
    port = PORT

    def ready_count() -> int:
        return notify.count("READY", "1")

    try:
        # Checks 1 and 2: phases, readiness, and the free-memory failure recovered by one retry.
        i1, _ = run.started(-1, 60)
        index, _, m = journal.wait(r"gb10d: free memory ([\d.]+) of ([\d.]+) GiB is below gpu_memory_utilization 0.9 .*restarting with ([\d.]+)", 400, i1)
        note("free-memory failure read from the real error", line=m.group(0))
        i2, pid2 = run.started(index, 60)
        notify.wait_for(lambda m: m.get("READY") == "1", 500)
        ready_at = next(stamp for stamp, m in notify.messages if m.get("READY") == "1")
        complete = [stamp for stamp, line in journal.lines if "Application startup complete." in line]
        statuses = notify.statuses()
        report["checks"]["1_ready_after_real_health"] = {
            "ready_status": next(m["STATUS"] for _, m in notify.messages if m.get("READY") == "1"),
            "startup_complete_to_ready_ms": round((ready_at - complete[-1]) * 1000, 1) if complete else None,
            "statuses": statuses,
            "health_after_ready": httpx.get(f"http://127.0.0.1:{port}/health").status_code,
            "models": httpx.get(f"http://127.0.0.1:{port}/v1/models").text[:300],
            "metrics_sample": [line for line in httpx.get("http://127.0.0.1:9400/metrics").text.splitlines()
                               if line.startswith("gb10d_") and not line.startswith("gb10d_phase")][:40],
        }
        report["checks"]["2_free_memory"] = {"failed_starts": 1, "journal": m.group(0), "starts": 2, "ready_once": ready_count() == 1}
        note("ready after free-memory recovery", ready=ready_count())

        # Check 3: SIGKILL the API server; its EngineCore survives on its own (vLLM has no parent-death check).
        engine = [p for p in group_members(pid2) if comm(p).startswith("VLLM::")]
        os.kill(pid2, signal.SIGKILL)
        time.sleep(0.5)
        right_after = gpu_processes()
        i3, pid3 = run.started(i2, 120)
        old_gone = not group_alive(pid2)
        after_restart = gpu_processes()
        report["checks"]["3_api_server_killed"] = {
            "engine_pids": engine, "gpu_right_after_kill": right_after, "old_group_gone_before_next_start": old_gone,
            "gpu_at_next_start": after_restart, "orphan_engine_in_gpu_list": any(r["pid"] in map(str, engine) for r in after_restart),
        }
        run.ready(2, 400)
        note("recovered after API server SIGKILL", ready=ready_count())

        # Check 4: SIGKILL the EngineCore; /health turns 503, vLLM exits 0, gb10d restarts it.
        engine = [p for p in group_members(pid3) if comm(p).startswith("VLLM::")]
        os.kill(engine[0], signal.SIGKILL)
        killed_at = time.monotonic()
        _, seen_at, m = journal.wait(r"gb10d: .*(restarting|giving up)", 60, i3)
        run.started(i3, 120)
        report["checks"]["4_engine_killed"] = {"engine_pid": engine[0], "noticed_after_s": round(seen_at - killed_at, 2), "journal": m.group(0)}
        run.ready(3, 400)
        note("recovered after EngineCore SIGKILL", ready=ready_count())

        # Check 5: SIGTERM to gb10d stops vLLM; nothing is left; exit 0.
        term_at = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        status = daemon.wait(120)
        report["checks"]["5_sigterm"] = {
            "exit_status": status, "seconds": round(time.monotonic() - term_at, 2),
            "groups_left": [g for g in run.groups if group_alive(g)], "gpu_after": gpu_processes(),
        }
        note("gb10d stopped", status=status)
    except Exception as exc:  # record and go on to the replay: a partial report is still evidence
        note("step failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        run.finish()
        os.killpg(hog.pid, signal.SIGKILL)

    # Check 6: the parser over every start's complete real output.
    report["checks"]["6_replay"] = run.replay_starts()
    run.pack_starts()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
