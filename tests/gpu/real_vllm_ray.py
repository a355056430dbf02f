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

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gb10d.daemon.lab import LineReader
from gb10d.launch.process import group_alive
from real_vllm import PORT, Journal, Run, driver_arguments, gpu_processes

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
    args = driver_arguments(__doc__ or "").parse_args()
    run = Run(args.out, "gb10d-real-ray")
    note, report, work = run.note, run.report, run.work
    config = run.write_config(
        args.model, args.program, 0.5,
        {"max_model_len": 2048, "enforce_eager": True, "distributed_executor_backend": "ray"},
        {"RAY_ADDRESS": "127.0.0.1:6379", "RAY_TMPDIR": str(work / "ray")},
    )

    ray_env = dict(os.environ, RAY_memory_monitor_refresh_ms="0", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(work / "ray"))
    ray_head = subprocess.Popen(
        [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()",
         "start", "--head", "--port", "6379", "--node-ip-address", "127.0.0.1", "--num-gpus", "1", "--block",
         "--disable-usage-stats", "--temp-dir", str(work / "ray")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ray_env, start_new_session=True,
    )
    assert ray_head.stdout is not None
    ray_log = Journal(LineReader(ray_head.stdout))
    ray_log.wait(r"Ray runtime started", 180)
    note("ray head started")

    run.start_gb10d(config)
    notify, journal, daemon = run.notify, run.journal, run.daemon
    try:
        i1, _ = run.started(-1, 60)
        run.ready(1, 500)
        completion = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions",
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
        run.started(index, 180)
        run.ready(2, 500)
        note("ready again", ready=notify.count("READY", "1"))

        term_at = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        status = daemon.wait(180)
        time.sleep(5)  # Ray's processes outside the group get a moment to go by themselves
        report["checks"]["3_sigterm"] = {
            "exit_status": status, "seconds": round(time.monotonic() - term_at, 2),
            "groups_left": [g for g in run.groups if group_alive(g)],
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
        run.finish()
        if group_alive(ray_head.pid):
            os.killpg(ray_head.pid, signal.SIGKILL)
        (run.out / "ray.txt").write_text("\n".join(line for _, line in ray_log.lines))

    report["checks"]["4_replay"] = run.replay_starts()
    report["checks"]["4_ray_lines"] = ray_lines(run.raw_dir)
    run.pack_starts()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
