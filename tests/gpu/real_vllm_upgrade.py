"""An upgrade that fails on a real GPU: gb10d goes back from a broken candidate venv to the real vLLM that served.

Run by tests/gpu/run-real-vllm.sh (`upgrade`) on a machine with an NVIDIA GPU
(not part of CI). The good program is a venv holding a real vLLM release; the
candidate is a venv as a failed `pip install -U vllm` leaves it: its `vllm`
console script is there, the package is not, so it dies with
`ModuleNotFoundError` before it ever serves. The run checks, for real:

1. gb10d serves from the good venv and records it as the good program (path, vLLM version, package hash);
2. a reload (SIGHUP) to the candidate fails its start, and gb10d goes back to
   the good venv with one journal line naming both programs and the cause;
3. READY=1 comes again from the good venv, whose banner names its release again;
4. `gb10d status` shows the good program and the rejected candidate;
5. a second reload to the same candidate is refused without starting anything;
6. SIGTERM stops gb10d with exit status 0.

Writes report.json, notify.json, journal.txt and programs.toml to the output directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from real_vllm import Run, driver_arguments

# real_vllm puts tests/ on the path.
from harness import wait_until

# What pip writes as a venv's `vllm` console script; the interpreter is the venv's own.
CONSOLE_SCRIPT = """#!{python}
import re
import sys
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def broken_venv(path: Path) -> Path:
    """A real venv whose `vllm` console script cannot import vLLM (the package is missing), as a failed upgrade leaves it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    script = path / "bin" / "vllm"
    script.write_text(CONSOLE_SCRIPT.format(python=path / "bin" / "python3"))
    script.chmod(0o755)
    return path


def gb10d_command(*words: str) -> dict[str, Any]:
    """A gb10d command as the operator runs it: its exit status and output."""
    out = subprocess.run([sys.executable, "-m", "gb10d", *words], capture_output=True, text=True, timeout=120)
    return {"status": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


def own_lines(run: Run, since: int, pattern: str) -> list[str]:
    """gb10d's own journal lines matching `pattern` from index `since` on."""
    return [line for _, line in run.journal.lines[since:] if re.search(pattern, line)]


def main() -> int:
    parser = driver_arguments(__doc__ or "")
    parser.add_argument("--good-venv", required=True, type=Path, help="a venv with a working vLLM")
    parser.add_argument("--version", required=True, help="the release the good venv holds")
    parser.add_argument("--utilization", type=float, default=0.5)
    args = parser.parse_args()
    run = Run(args.out, "gb10d-upgrade")
    note, report = run.note, run.report
    for old in run.work.glob("learned*"):  # a record from an earlier run would make the good venv a candidate
        old.unlink()
    broken = broken_venv(run.work / "vllm-broken")
    # Eager mode: the upgrade is what is checked here, and each start is half a minute shorter.
    settings: dict[str, Any] = {"max_model_len": 2048, "enforce_eager": True}

    def configure(venv: Path) -> Path:
        """Point the config at `venv`."""
        return run.write_program_config({"venv": str(venv)}, args.model, args.utilization, settings, {})

    config = configure(args.good_venv)
    run.start_gb10d(config)
    version = re.escape(args.version)
    programs = run.work / "learned.programs.toml"
    try:
        # 1. The good venv serves and is recorded.
        run.started(-1, 60)
        run.ready(1, 400)
        _, _, m = run.journal.wait(rf"gb10d: vLLM is ready after .*vLLM version {version}$", 30)
        wait_until(lambda: programs.exists() and "[good]" in programs.read_text(), 30, "the good program recorded")
        report["checks"]["1_good_serves"] = {"journal": m.group(0), "record": programs.read_text()}
        note("the good venv serves", ready=run.notify.count("READY", "1"))

        # 2-3. A reload to the broken candidate, and back to the good venv.
        since = len(run.journal.lines)
        configure(broken)
        reloaded_at = time.monotonic()
        os.kill(run.daemon.pid, signal.SIGHUP)
        _, back_at, m = run.journal.wait(r"gb10d: the candidate .* failed its start: .*; going back to the last good .*", 300, since)
        run.ready(2, 400)
        ready_at = time.monotonic()
        _, _, ready = run.journal.wait(rf"gb10d: vLLM is ready after .*vLLM version {version}$", 30, since)
        report["checks"]["2_rollback"] = {
            "journal": m.group(0), "rollback_lines": len(own_lines(run, since, r"going back to the last good")),
            "seconds_reload_to_rollback_line": round(back_at - reloaded_at, 2), "seconds_reload_to_ready": round(ready_at - reloaded_at, 2),
            "starts": own_lines(run, since, r"gb10d: started vLLM as pid"), "candidate_output": own_lines(run, since, r"Error|Traceback|vllm"),
        }
        report["checks"]["3_ready_again"] = {"journal": ready.group(0), "ready_count": run.notify.count("READY", "1")}
        note("back on the good venv", ready=run.notify.count("READY", "1"))
        report["checks"]["4_status"] = gb10d_command("status", "--config", str(config))
        (args.out / "programs.toml").write_text(programs.read_text())

        # 5. The same candidate again is refused until the operator says it is fixed.
        since = len(run.journal.lines)
        configure(broken)
        os.kill(run.daemon.pid, signal.SIGHUP)
        _, _, refused = run.journal.wait(r"gb10d: config not applied: it runs the candidate .*", 60, since)
        report["checks"]["5_refused"] = {"journal": refused.group(0), "starts_after": own_lines(run, since, r"gb10d: started vLLM as pid")}
        configure(args.good_venv)

        # 6. SIGTERM: a clean stop.
        term_at = time.monotonic()
        run.daemon.send_signal(signal.SIGTERM)
        report["checks"]["6_sigterm"] = {"exit_status": run.daemon.wait(120), "seconds": round(time.monotonic() - term_at, 2)}
        note("gb10d stopped")
    except Exception as exc:  # record and go on: a partial report is still evidence
        note("step failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        run.finish()
    note("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
