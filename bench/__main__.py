"""`python -m bench`: run the benchmarks, write results JSON and Markdown tables, enforce the quick bounds.

The full run (all six items of issue 7, item 7: vLLM in a container next
to the venv, the front beside nginx and a model swap; about 17 minutes)
writes `bench/results/latest.json` and `latest.md`; `--only front` or
`--only swap` runs one item (as `python -m bench.front` and `bench.swap`,
which keep their own results files). `--quick` (under 2 minutes:
readiness and forwarding only, fewer repeats) writes `quick.json` and
`quick.md`. Either run exits 1 when a regression bound (readiness or
forwarding against its same-run baseline) does not hold, so CI can gate on
it; the issue's goals are reported, not enforced.

`python -m bench soak --minutes N --seed S` (bench/soak.py) is apart: the
front and three instances under clients and faults, with arguments of its
own (`python -m bench soak --help`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from . import container, footprint, forwarding, front, readiness, recovery, report, shutdown, soak, stall, swap
from .lab import Workspace

SUITES: dict[str, ModuleType] = {
    "readiness": readiness,
    "recovery": recovery,
    "stall": stall,
    "forwarding": forwarding,
    "footprint": footprint,
    "shutdown": shutdown,
    "container": container,
    "front": front,
    "swap": swap,
}
QUICK = ("readiness", "forwarding")
ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:
        return soak.main(argv[1:])
    items = "\n".join(f"  {name:<11} {(module.__doc__ or '').strip().splitlines()[0]}" for name, module in SUITES.items())
    items += "\n  soak        python -m bench soak --minutes N --seed S: the front and three instances under clients and faults (soak --help)"
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0], epilog=f"items:\n{items}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CI version: readiness and forwarding, under 2 minutes")
    parser.add_argument("--only", action="append", choices=sorted(SUITES), help="run only this item (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results", help="where to write the results")
    args = parser.parse_args(argv)
    names = args.only or (QUICK if args.quick else tuple(SUITES))
    started = time.monotonic()
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "machine": report.machine(),
                               "commit": report.git_commit(ROOT), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    ws = Workspace()
    try:
        for name in names:
            t0 = time.monotonic()
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            results[name] = SUITES[name].run(ws, args.quick)
            print(f"bench: {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        ws.close()
    results["wall_s"] = time.monotonic() - started
    results["checks"] = report.checks(results)
    results["goals"] = report.goals(results)
    stem = "quick" if args.quick else "latest"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report.markdown(results)
    (args.out / f"{stem}.md").write_text(text + "\n")
    print(text)
    failed = [c for c in results["checks"] if not c["ok"]]
    for c in failed:
        print(f"bench: regression bound not held: {c['check']} = {c['value']} (bound {c['bound']})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
