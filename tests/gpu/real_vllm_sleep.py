"""Swaps by sleep through `gb10d front` on a real vLLM: two instances of different models on one GPU, then one bad wake.

Run by `tests/gpu/run-real-vllm.sh sleep` on a machine with an NVIDIA GPU (not part of CI); with
`--program "python -m gb10d.sim"` it runs the same steps against the stand-in. Each model is a `gb10d run` with
`[on_demand] park = "sleep"` and a short `idle_timeout_s` on a loopback port, both share one memory ledger, and
`gb10d front` stands before them. Requests go to each model in turn, so each wakes while the other sleeps; every
swap's times, the GPU memory (nvidia-smi and vLLM's own `Sleep mode freed` line), the journals and the sd_notify
messages are recorded. Then the larger model's vLLM skips `reload_weights` (skipreload/sitecustomize.py, while a
flag file exists: a fault made in vLLM's process, since gb10d has no such switch): gb10d's check generation must
catch the wake, stop vLLM and start it cold. Writes report.json, journal-*.txt, notify-*.json, front.txt and
raw.tar.gz (every start's own output) to the output directory; a step that fails is recorded and the rest still
reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import tomli_w

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gb10d.daemon.lab import Gb10d, wait_until  # noqa: E402
from gb10d.front.lab import FrontChild  # noqa: E402
from gb10d.machine.statefile import read_state  # noqa: E402
from harness import NotifySocket  # noqa: E402
from real_vllm import Journal, Run, driver_arguments, gpu_processes  # noqa: E402

FRONT_PORT = 8000
IDLE_S = 5.0
# Lines of one wake, in order, as gb10d forwards them (vLLM's own, then gb10d's verdict).
WAKE_LINES = {
    "weights_woken": r"It took ([\d.]+) seconds to wake up tags \['weights'\]",
    "reloaded": r"Reloading and processing weights took ([\d.]+) seconds",
    "kv_cache_woken": r"It took ([\d.]+) seconds to wake up tags \['kv_cache'\]",
    "woke": r"gb10d: woke vLLM in ([\d.]+) s",
}
PARK_LINES = {
    "vllm_freed": r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use",
    "fell_asleep": r"It took ([\d.]+) seconds to fall asleep",
    "parked": r"gb10d: vLLM sleeps \(level 2\) after ([\d.]+) s: ([\d.]+) GiB given back",
}


def gpu_used_mib() -> int | None:
    """The GPU's memory in use as nvidia-smi counts it (every process), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return None
    return int(out.split()[0]) if out.split() else None


class Instance:
    """One `gb10d run` with `[on_demand] park = "sleep"`: its config, its vLLM wrapper, its journal and notify socket."""

    def __init__(self, run: Run, name: str, model: str, program: str, port: int, args: argparse.Namespace, skip_flag: Path | None) -> None:
        self.name = name
        self.work = run.work / name
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_file = self.work / "state.json"
        wrapper = self.work / "vllm"
        wrapper.write_text(
            "#!/bin/bash\n"
            f'n={name}-$(date +%s%N); exec > >(tee "{run.raw_dir}/$n.stdout") 2> >(tee "{run.raw_dir}/$n.stderr" >&2)\n'
            f'exec {program} "$@"\n'
        )
        wrapper.chmod(0o755)
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if skip_flag is not None:  # the fault's hook first on vLLM's path; the rest as gb10d's environment has it
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE / "skipreload"), os.environ.get("PYTHONPATH", "")) if p)
            env["GB10D_SKIP_RELOAD_FLAG"] = str(skip_flag)
        vllm_args: dict[str, Any] = {"max_model_len": 2048}
        if args.eager:
            vllm_args["enforce_eager"] = True
        self.config = self.work / "gb10d.toml"
        self.config.write_text(tomli_w.dumps({
            "vllm": {
                "executable": str(wrapper), "model": model, "served_model_name": name, "host": "127.0.0.1", "port": port,
                "gpu_memory_utilization": args.utilization, "args": vllm_args, "env": env,
            },
            "on_demand": {"park": "sleep", "idle_timeout_s": IDLE_S},
            "startup": {"stall_timeout_s": 180.0, "ready_timeout_s": 600.0},
            # Host /proc/meminfo says nothing about a discrete GPU's own memory: only vLLM's error can.
            "memory": {"preflight": False, "recovery_timeout_s": 30.0, "min_gpu_memory_utilization": 0.1, "ledger_dir": str(run.work / "ledger")},
            "restart": {"max_attempts": 4, "backoff_initial_s": 1.0, "backoff_max_s": 5.0},
            "liveness": {"health_interval_s": 1.0},
            "metrics": {"listen": f"127.0.0.1:{port + 1400}"},
            "daemon": {"state_file": str(self.state_file), "learned_file": str(self.work / "learned.toml"), "watch_config": False},
        }))

    def start(self) -> None:
        self.notify = NotifySocket()
        self.gb10d = Gb10d(self.config, self.notify, env={"PYTHONUNBUFFERED": "1"})
        assert self.gb10d.out is not None
        self.journal = Journal(self.gb10d.out)

    def ready(self, count: int, timeout: float) -> None:
        """Until READY=1 came `count` times; gb10d exiting first fails the step."""
        wait_until(lambda: self.notify.count("READY", "1") >= count or self.gb10d.proc.poll() is not None, timeout)
        assert self.gb10d.proc.poll() is None, f"{self.name}'s gb10d exited with status {self.gb10d.proc.returncode}:\n{self.gb10d.tail()}"
        assert self.notify.count("READY", "1") >= count, f"{self.name}: no READY=1 number {count} within {timeout} s:\n{self.gb10d.tail()}"

    def state(self) -> str | None:
        record = read_state(self.state_file)
        return record.state.value if record is not None and record.state is not None else None

    def wait_state(self, state: str, timeout: float) -> None:
        assert wait_until(lambda: self.state() == state, timeout) is not None, f"{self.name} never reached {state} (is {self.state()}):\n{self.gb10d.tail()}"

    def lines_since(self, patterns: dict[str, str], after: int, t0: float, timeout: float) -> dict[str, Any]:
        """For each pattern, in order, the first matching line from index `after` on: its numbers and arrival after t0."""
        found: dict[str, Any] = {}
        for key, pattern in patterns.items():
            try:
                index, at, m = self.journal.wait(pattern, timeout, after)
            except TimeoutError:
                found[key] = None
                continue
            found[key] = {"values": [float(v) for v in m.groups()], "at_s": round(at - t0, 3)}
            after = index
        return found


def main() -> int:
    parser = driver_arguments(__doc__ or "")
    parser.add_argument("--large-model", required=True, help="the second model, of another size (the one whose wake goes bad)")
    parser.add_argument("--utilization", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager: no torch.compile nor CUDA graphs, a shorter start")
    args = parser.parse_args()
    run = Run(args.out, "gb10d-sleep")
    note, report = run.note, run.report
    flag = run.work / "skip-reload"
    flag.unlink(missing_ok=True)
    small = Instance(run, "small", args.model, args.program, 8001, args, None)
    large = Instance(run, "large", args.large_model, args.program, 8002, args, flag)
    (run.work / "instances").mkdir(exist_ok=True)
    for inst in (small, large):
        (run.work / "instances" / f"{inst.name}.toml").write_text(inst.config.read_text())
    front_toml = run.work / "front.toml"
    front_toml.write_text(tomli_w.dumps({"front": {
        "listen": f"127.0.0.1:{FRONT_PORT}", "metrics_listen": "127.0.0.1:9500", "instances_dir": str(run.work / "instances"),
        "hold_timeout_s": 600.0, "state_file": str(run.work / "front-state.json"),
    }}))
    front = FrontChild(front_toml)
    url = f"http://127.0.0.1:{FRONT_PORT}"
    report["memory"] = []
    report["swaps"] = []

    def memory(what: str) -> None:
        report["memory"].append({"what": what, "gpu_used_mib": gpu_used_mib(), "processes": gpu_processes(),
                                 "states": {i.name: i.state() for i in (small, large)}})
        note(f"memory: {what}", used_mib=report["memory"][-1]["gpu_used_mib"])

    def ask(client: httpx.Client, inst: Instance) -> dict[str, Any]:
        sent = time.monotonic()
        reply = client.post("/v1/completions", json={"model": inst.name, "prompt": "hello world", "max_tokens": 8, "temperature": 0})
        return {"status": reply.status_code, "text": reply.json()["choices"][0]["text"] if reply.status_code == 200 else reply.text[:300],
                "seconds": round(time.monotonic() - sent, 3), "sent": sent}

    try:
        front.wait_line(r"serving (small, large|large, small) on ", 60)
        # One start at a time: two vLLM profiling the same GPU at once would count each other's memory.
        for inst in (small, large):
            inst.start()
            inst.ready(1, 500)
            note(f"{inst.name} ready", status=next(m["STATUS"] for _, m in inst.notify.messages if m.get("READY") == "1"))
        memory("both serving")
        with httpx.Client(base_url=url, timeout=600) as client:
            for inst in (small, large):
                inst.wait_state("asleep", 120)
            parks = {i.name: i.lines_since(PARK_LINES, 0, run.t0, 10) for i in (small, large)}
            report["first_parks"] = parks
            memory("both asleep")
            for round_number in range(1, args.rounds + 1):
                for inst in (small, large):
                    other = large if inst is small else small
                    assert other.state() == "asleep" and inst.state() == "asleep", (inst.state(), other.state())
                    after = len(inst.journal.lines)
                    answer = ask(client, inst)
                    sent = answer.pop("sent")
                    wake = inst.lines_since(WAKE_LINES, after, sent, 10)
                    memory(f"{inst.name} awake, round {round_number}")
                    inst.wait_state("asleep", 120)
                    park = inst.lines_since(PARK_LINES, after, sent, 10)
                    report["swaps"].append({"round": round_number, "model": inst.name, "answer": answer, "wake": wake, "park": park})
                    note(f"swap to {inst.name}", answer=answer, woke=wake["woke"])
            memory("both asleep after the swaps")

            # The bad wake: the large model's vLLM skips reload_weights while the flag exists.
            flag.touch()
            after = len(large.journal.lines)
            starts_before = len(large.gb10d.vllm_pgids())
            answer = ask(client, large)
            sent = answer.pop("sent")
            bad: dict[str, Any] = {"answer": answer}
            flag.unlink()
            _, at, m = large.journal.wait(r"gb10d: the wake looked fine but .*", 10, after)
            bad["wake_failed"] = {"line": m.group(0), "at_s": round(at - sent, 3)}
            _, at, m = large.journal.wait(r"gb10d: started vLLM as .*", 10, after)
            bad["cold_start"] = {"line": m.group(0)[:200], "at_s": round(at - sent, 3)}
            bad["skip_line"] = [line for _, line in large.journal.lines[after:] if "skipreload:" in line][:2]
            bad["reload_line"] = [line for _, line in large.journal.lines[after:] if "Reloading and processing weights" in line][:2]
            large.ready(2, 300)
            ready_at = next(stamp for stamp, msg in reversed(large.notify.messages) if msg.get("READY") == "1")
            bad["ready_again_s"] = round(ready_at - sent, 3)
            bad["starts"] = len(large.gb10d.vllm_pgids()) - starts_before
            report["bad_wake"] = bad
            note("bad wake", **{k: v for k, v in bad.items() if k != "skip_line"})
            memory("large cold-started after the bad wake")

            # After the cold start: parked and woken once more, the reload done again.
            large.wait_state("asleep", 120)
            after = len(large.journal.lines)
            answer = ask(client, large)
            sent = answer.pop("sent")
            report["wake_after_cold_start"] = {"answer": answer, "wake": large.lines_since(WAKE_LINES, after, sent, 10)}
            note("wake after the cold start", **report["wake_after_cold_start"])
            report["front_metrics"] = [line for line in httpx.get("http://127.0.0.1:9500/metrics").text.splitlines()
                                       if line.startswith("gb10d_front_swaps") or line.startswith("gb10d_front_requests_total")]
            report["gb10d_metrics"] = {i.name: [line for line in httpx.get(f"http://127.0.0.1:{8001 + 1400 + (i is large)}/metrics").text.splitlines()
                                                if "wake" in line and not line.startswith("#")] for i in (small, large)}
        # SIGTERM to each gb10d while its vLLM sleeps or serves.
        stops = {}
        for inst in (small, large):
            state, stopped = inst.state(), time.monotonic()
            inst.gb10d.terminate()
            stops[inst.name] = {"state": state, "exit_status": inst.gb10d.wait_exit(120), "seconds": round(time.monotonic() - stopped, 2)}
        report["stops"] = stops
        memory("after SIGTERM")
        note("stopped", **stops)
    except Exception as exc:  # record and go on: a partial report is still evidence
        note("step failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        front.close()
        (run.out / "front.txt").write_text("\n".join(f"{stamp - run.t0:9.3f} {line}" for stamp, line in front.out.lines))
        for inst in (small, large):
            if not hasattr(inst, "gb10d"):
                continue
            inst.gb10d.close()
            (run.out / f"notify-{inst.name}.json").write_text(json.dumps([{"t": round(s - run.t0, 3), **m} for s, m in inst.notify.messages], indent=1))
            (run.out / f"journal-{inst.name}.txt").write_text("\n".join(f"{s - run.t0:9.3f} {line}" for s, line in inst.journal.lines))
            inst.notify.close()
    report["replay"] = run.replay_starts()
    run.pack_starts()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
