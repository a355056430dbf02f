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
6. with --next-venv, a reload to a venv holding another release (a candidate
   that works) serves it, and it is the good program from then on;
7. SIGTERM stops gb10d with exit status 0.

Writes report.json, notify.json, journal.txt and programs.toml to the output directory.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# real_vllm puts tests/ on the path.
from harness import wait_until
from real_vllm import Run, driver_arguments

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


class Upgrade:
    """One driver run: `gb10d run` on the good venv, and the reloads that point its config elsewhere."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = Run(args.out, "gb10d-upgrade")
        for old in self.run.work.glob("learned*"):  # a record from an earlier run would make the good venv a candidate
            old.unlink()
        self.programs = self.run.work / "learned.programs.toml"
        self.config = self.configure(args.good_venv)

    def configure(self, venv: Path) -> Path:
        """Point the config at `venv` (eager mode: the upgrade is what is checked, and each start is shorter)."""
        settings: dict[str, Any] = {"max_model_len": 2048, "enforce_eager": True}
        return self.run.write_program_config({"venv": str(venv)}, self.args.model, self.args.utilization, settings, {})

    def reload(self, venv: Path) -> tuple[int, float]:
        """Point the config at `venv` and SIGHUP gb10d: where the journal stood, and when."""
        since = len(self.run.journal.lines)
        self.configure(venv)
        os.kill(self.run.daemon.pid, signal.SIGHUP)
        return since, time.monotonic()

    def ready_on(self, version: str, count: int, since: int) -> str:
        """READY=1 number `count`, from a start whose ready line names `version`."""
        self.run.ready(count, 400)
        _, _, m = self.run.journal.wait(rf"gb10d: vLLM is ready after .*vLLM version {re.escape(version)}$", 30, since)
        return m.group(0)

    def good_is(self, venv: Path) -> str:
        """gb10d writes its record right after READY=1: until it names `venv` as the good program."""
        wait_until(lambda: self.programs.exists() and f'path = "{venv}"' in self.programs.read_text().split("[rejected]")[0], 30,
                   f"{venv} recorded as the good program")
        return self.programs.read_text()

    def roll_back(self, broken: Path) -> None:
        """A reload to the broken candidate: one journal line, and READY=1 again from the good venv."""
        run, report = self.run, self.run.report
        since, reloaded_at = self.reload(broken)
        _, back_at, m = run.journal.wait(r"gb10d: the candidate .* failed its start: .*; going back to the last good .*", 300, since)
        ready = self.ready_on(self.args.version, 2, since)
        report["checks"]["2_rollback"] = {
            "journal": m.group(0), "rollback_lines": len(own_lines(run, since, r"going back to the last good")),
            "seconds_reload_to_rollback_line": round(back_at - reloaded_at, 2), "seconds_reload_to_ready": round(time.monotonic() - reloaded_at, 2),
            "starts": own_lines(run, since, r"gb10d: started vLLM as pid"), "candidate_output": own_lines(run, since, r"Error|Traceback|vllm"),
        }
        report["checks"]["3_ready_again"] = {"journal": ready, "ready_count": run.notify.count("READY", "1")}
        run.note("back on the good venv", ready=run.notify.count("READY", "1"))
        report["checks"]["4_status"] = gb10d_command("status", "--config", str(self.config))

    def refused(self, broken: Path) -> None:
        """The same candidate again is refused until the operator says it is fixed."""
        since, _ = self.reload(broken)
        _, _, refused = self.run.journal.wait(r"gb10d: config not applied: it runs the candidate .*", 60, since)
        self.run.report["checks"]["5_refused"] = {"journal": refused.group(0), "starts_after": own_lines(self.run, since, r"gb10d: started vLLM as pid")}

    def promote(self, venv: Path, version: str) -> None:
        """A candidate that works (another release in another venv) serves and is the good program from then on."""
        since, reloaded_at = self.reload(venv)
        _, _, m = self.run.journal.wait(rf"gb10d: the candidate {re.escape(str(venv))} .* served: it is the good program from now on.*", 400, since)
        self.run.report["checks"]["6_candidate_served"] = {
            "journal": m.group(0), "ready": self.ready_on(version, 4, since), "record": self.good_is(venv),
            "seconds_reload_to_ready": round(time.monotonic() - reloaded_at, 2), "status": gb10d_command("status", "--config", str(self.config)),
        }
        self.run.note("the candidate is the good program", ready=self.run.notify.count("READY", "1"))


def main() -> int:
    parser = driver_arguments(__doc__ or "")
    parser.add_argument("--good-venv", required=True, type=Path, help="a venv with a working vLLM")
    parser.add_argument("--version", required=True, help="the release the good venv holds")
    parser.add_argument("--next-venv", type=Path, help="a venv with another working release: a candidate that should become good")
    parser.add_argument("--next-version", help="the release the next venv holds")
    parser.add_argument("--utilization", type=float, default=0.5)
    args = parser.parse_args()
    upgrade = Upgrade(args)
    run, report = upgrade.run, upgrade.run.report
    broken = broken_venv(run.work / "vllm-broken")
    run.start_gb10d(upgrade.config)
    try:
        run.started(-1, 60)
        report["checks"]["1_good_serves"] = {"journal": upgrade.ready_on(args.version, 1, 0), "record": upgrade.good_is(args.good_venv)}
        run.note("the good venv serves", ready=run.notify.count("READY", "1"))
        upgrade.roll_back(broken)
        upgrade.refused(broken)
        (args.out / "programs.toml").write_text(upgrade.programs.read_text())
        if args.next_venv is not None and args.next_version is not None:
            upgrade.promote(args.next_venv, args.next_version)
            (args.out / "programs.toml").write_text(upgrade.programs.read_text())
        term_at = time.monotonic()
        run.daemon.send_signal(signal.SIGTERM)
        report["checks"]["7_sigterm"] = {"exit_status": run.daemon.wait(120), "seconds": round(time.monotonic() - term_at, 2)}
        run.note("gb10d stopped")
    except Exception as exc:  # record and go on: a partial report is still evidence
        run.note("step failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        run.finish()
    run.note("done")
    return 0

if __name__ == "__main__":
    sys.exit(main())
