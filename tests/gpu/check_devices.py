"""On a machine with an NVIDIA GPU: the unit's DeviceAllow= patterns against the driver's own device groups,
and gb10d's preflight open of the devices, as root and as an unprivileged user.

Run from the repository root: `python3 tests/gpu/check_devices.py OUTDIR`; it needs only the standard library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gb10d.machine.devices import NVIDIA_NODES, check_gpu_access, matches, parse_proc_devices, probe_nodes
from gb10d.machine.host import read_host_facts

UNITS = Path(__file__).resolve().parents[2] / "units"


def main(out: Path) -> int:
    groups = parse_proc_devices(Path("/proc/devices").read_text())
    report: dict[str, object] = {"nvidia_groups": [[g.major, g.name] for g in groups if g.name.startswith("nvidia")]}
    for unit in ("gb10d.service", "gb10d@.service"):
        allow = [line.partition("=")[2] for line in (UNITS / unit).read_text().splitlines() if line.startswith("DeviceAllow=")]
        report[unit] = {g.name: any(matches(a, g.name) for a in allow) for g in groups if g.name.startswith("nvidia")}
    report["nodes"] = [[str(n.path), n.error, n.owner, n.group, oct(n.mode)] for n in probe_nodes((*NVIDIA_NODES, Path("/dev/nvidia0")))]
    report["check_as_root"] = check_gpu_access("gb10d")
    nobody = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import sys; sys.path.insert(0, '.'); from gb10d.machine.devices import check_gpu_access; print(repr(check_gpu_access('gb10d')))"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
    )
    report["check_as_nobody"] = nobody.stdout.strip() or nobody.stderr.strip()
    report["host"] = read_host_facts(Path("/proc/meminfo"), os.environ).summary()
    text = json.dumps(report, indent=1)
    print(text)
    (out / "devices.json").write_text(text + "\n")
    denied = [name for unit in ("gb10d.service", "gb10d@.service") for name, ok in report[unit].items() if not ok]  # type: ignore[union-attr]
    return 1 if denied or report["check_as_root"] is not None else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
