"""gb10d supervising a real vLLM that runs its model through Ray (`--distributed-executor-backend ray`).

Run by tests/gpu/run-real-vllm-ray.sh on a machine with an NVIDIA GPU and
vLLM and Ray importable (not part of CI). One GPU is enough: a Ray head is
started as gb10d starts it on a pair's head (`ray start --head --block`,
RAY_ADDRESS for vLLM), vLLM places one RayWorkerWrapper actor on it, and
that actor prints through Ray's `(RayWorkerWrapper pid=N)` prefix, the path
a remote worker's lines take on a two-machine pair. The run checks, on real output:

1. gb10d sends READY=1 for a Ray-backed vLLM and a completion is answered;
2. killing the RayWorkerWrapper actor is noticed, named and restarted;
3. after SIGTERM to gb10d, nothing of vLLM or Ray is left running;
4. gb10d's parser over every start's complete output (line kinds, events,
   phases), with the lines that carry Ray's prefixes or its errors.

Writes report.json, notify.json, journal.txt and raw.tar.gz to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import tomli_w

from real_vllm import Journal, gpu_processes, replay

from harness import NotifySocket, wait_until

from gb10d.process import group_alive

RAY_MARKERS = ("RayWorkerProc", "RayWorkerWrapper", "ActorDiedError", "RayActorError", "ActorUnavailableError", "RayTaskError", "ray.exceptions")


def processes_matching(*needles: str) -> list[dict[str, Any]]:
    """Live processes whose command line contains one of `needles`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found.append({"pid": int(entry.name), "cmdline": cmdline[:200]})
    return found


def ray_lines(raw_dir: Path, limit: int = 80) -> list[str]:
    """The lines of every start that come from Ray's workers or name Ray's errors."""
    lines = []
    for path in sorted(raw_dir.iterdir()):
        for line in path.read_text("utf-8", "replace").splitlines():
            if any(marker in line for marker in RAY_MARKERS):
                lines.append(f"{path.name}: {line[:400]}")
    return lines[:limit]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--program",
        default="python3 -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv[0]=\"vllm\"; sys.exit(main())'",
        help="what the vllm wrapper execs (a dry run points it at gb10d.sim)",
    )
    args = parser.parse_args()
    out: Path = args.out
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("HOME", "/tmp")) / "gb10d-real-ray"
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"checks": {}, "timeline": []}
    t0 = time.monotonic()

    def note(what: str, **facts: Any) -> None:
        report["timeline"].append({"t": round(time.monotonic() - t0, 3), "what": what, **facts})
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print(f"[{time.monotonic() - t0:7.1f}s] {what} {facts if facts else ''}", flush=True)

    wrapper = work / "vllm"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'n=$(date +%s%N); exec > >(tee "{raw_dir}/$n.stdout") 2> >(tee "{raw_dir}/$n.stderr" >&2)\n'
        f'exec {args.program} "$@"\n'
    )
    wrapper.chmod(0o755)
    port = 8000
    config = work / "gb10d.toml"
    config.write_text(tomli_w.dumps({
        "vllm": {
            "executable": str(wrapper), "model": args.model, "served_model_name": "tiny", "host": "127.0.0.1", "port": port,
            "gpu_memory_utilization": 0.5,
            "args": {"max_model_len": 2048, "enforce_eager": True, "distributed_executor_backend": "ray"},
            "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "RAY_ADDRESS": "127.0.0.1:6379", "RAY_TMPDIR": str(work / "ray")},
        },
        "startup": {"stall_timeout_s": 180.0, "ready_timeout_s": 600.0},
        "memory": {"preflight": False, "recovery_timeout_s": 30.0, "min_gpu_memory_utilization": 0.1},
        "restart": {"max_attempts": 4, "backoff_initial_s": 1.0, "backoff_max_s": 5.0},
        "liveness": {"health_interval_s": 1.0},
        "metrics": {"listen": "127.0.0.1:9400"},
        "daemon": {"state_file": str(work / "state.json"), "learned_file": str(work / "learned.toml"), "watch_config": False},
    }))

    ray_env = dict(os.environ, RAY_memory_monitor_refresh_ms="0", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(work / "ray"))
    ray_head = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
         "start", "--head", "--port", "6379", "--node-ip-address", "127.0.0.1", "--num-gpus", "1", "--block",
         "--disable-usage-stats", "--temp-dir", str(work / "ray")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ray_env, start_new_session=True,
    )
    ray_log = Journal(ray_head)
    ray_log.wait(r"Ray runtime started", 180)
    note("ray head started")

    notify = NotifySocket()
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, PYTHONUNBUFFERED="1")
    daemon = subprocess.Popen([sys.executable, "-m", "gb10d", "run", "--config", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    journal = Journal(daemon)
    groups: list[int] = []

    def ready(count: int, timeout: float) -> None:
        wait_until(lambda: notify.count("READY", "1") >= count or daemon.poll() is not None, timeout, f"READY=1 number {count}")
        assert daemon.poll() is None, f"gb10d exited with status {daemon.returncode}"

    def started(after: int, timeout: float) -> int:
        index, _, m = journal.wait(r"gb10d: started vLLM as pid (\d+)", timeout, after + 1)
        groups.append(int(m.group(1)))
        return index

    try:
        i1 = started(-1, 60)
        ready(1, 500)
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "tiny", "prompt": "Hello", "max_tokens": 5}, timeout=60)
        report["checks"]["1_ready"] = {
            "ready_status": next(m["STATUS"] for _, m in notify.messages if m.get("READY") == "1"),
            "completion_status": completion.status_code, "completion": completion.text[:300],
            "ray_processes": processes_matching("ray::", "raylet", "gcs_server"),
            "gpu": gpu_processes(),
        }
        note("ready", completion=completion.status_code)

        # V2 (0.23's default) names the actor RayWorkerProc, V1 RayWorkerWrapper.
        actors = processes_matching("RayWorkerProc", "RayWorkerWrapper")
        victim = actors[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        index, seen_at, m = journal.wait(r"gb10d: .*(restarting|giving up)", 180, i1)
        report["checks"]["2_actor_killed"] = {
            "actors": actors, "victim": victim, "noticed_after_s": round(seen_at - killed_at, 2), "decision": m.group(0),
            "own_lines_after_kill": [line for _, line in journal.lines[i1:] if "gb10d:" in line][-12:],
        }
        note("actor kill noticed", line=m.group(0))
        started(index, 180)
        ready(2, 500)
        note("ready again", ready=notify.count("READY", "1"))

        term_at = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        status = daemon.wait(180)
        time.sleep(5)  # Ray's processes outside the group get a moment to go by themselves
        report["checks"]["3_sigterm"] = {
            "exit_status": status, "seconds": round(time.monotonic() - term_at, 2),
            "groups_left": [g for g in groups if group_alive(g)],
            # The Ray head is the driver's and still up here; vLLM's actors must be gone.
            "actors_left": processes_matching("RayWorkerProc", "RayWorkerWrapper"),
            "gpu_after": gpu_processes(),
        }
        note("gb10d stopped", status=status)
        os.killpg(ray_head.pid, signal.SIGTERM)
        ray_head.wait(60)
        report["checks"]["3_sigterm"]["ray_left_after_ray_stop"] = processes_matching("ray::", "raylet", "gcs_server", "RayWorkerProc", "RayWorkerWrapper")
    except Exception as exc:  # record and go on to the replay: a partial report is still evidence
        note("step failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
        for g in [*groups, ray_head.pid]:
            if group_alive(g):
                os.killpg(g, signal.SIGKILL)
        (out / "ray.txt").write_text("\n".join(line for _, line in ray_log.lines))
        (out / "notify.json").write_text(json.dumps([{"t": round(s - t0, 3), **m} for s, m in notify.messages], indent=1))
        (out / "journal.txt").write_text("\n".join(f"{s - t0:9.3f} {line}" for s, line in journal.lines))
        notify.close()

    replays = {}
    for stdout in sorted(raw_dir.glob("*.stdout")):
        stderr = stdout.with_suffix(".stderr")
        if stderr.exists():
            replays[stdout.stem] = replay(stdout, stderr)
    report["checks"]["4_replay"] = replays
    report["checks"]["4_ray_lines"] = ray_lines(raw_dir)
    with tarfile.open(out / "raw.tar.gz", "w:gz") as tar:
        tar.add(raw_dir, arcname="raw")
    for f in raw_dir.iterdir():
        f.unlink()
    raw_dir.rmdir()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
