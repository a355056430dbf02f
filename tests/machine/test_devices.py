"""The NVIDIA devices under the unit's device policy: what DeviceAllow= admits, and the preflight's open check."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gb10d.machine.devices import (
    NVIDIA_DEVICE_ALLOW,
    DeviceGroup,
    NodeAccess,
    access_problem,
    check_gpu_access,
    matches,
    parse_proc_devices,
)
from gb10d.machine.service import unit_name

REPO = Path(__file__).resolve().parents[2]

# /proc/devices as each NVIDIA driver generation registers its character devices (REFERENCE §14).
DRIVER_580 = """Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
195 nvidia
195 nvidiactl
238 nvidia-uvm
239 nvidia-nvswitch
240 nvidia-nvlink
241 nvidia-caps
242 nvidia-caps-imex-channels

Block devices:
  8 sd
259 blkext
"""
# Before 550.40 the GPU and control devices were one group, nvidia-frontend.
DRIVER_BEFORE_550 = """Character devices:
  1 mem
195 nvidia-frontend
237 nvidia-uvm
238 nvidia-caps

Block devices:
  8 sd
"""
# The groups behind the nodes vLLM opens: /dev/nvidia0 and /dev/nvidiactl (195), /dev/nvidia-uvm.
NEEDED = {
    "580": ["nvidia", "nvidiactl", "nvidia-uvm"],
    "before 550.40": ["nvidia-frontend", "nvidia-uvm"],
}
PROC_DEVICES = {"580": DRIVER_580, "before 550.40": DRIVER_BEFORE_550}


def device_allow(unit: str) -> list[str]:
    """The values of every DeviceAllow= line of a shipped unit."""
    lines = (REPO / "units" / unit).read_text().splitlines()
    return [line.partition("=")[2] for line in lines if line.startswith("DeviceAllow=")]


def allowed(patterns: list[str], group: str) -> bool:
    return any(matches(pattern, group) for pattern in patterns)


@pytest.mark.parametrize("unit", ["gb10d.service", "gb10d@.service"])
@pytest.mark.parametrize("driver", sorted(NEEDED))
def test_the_units_allow_every_device_group_vllm_opens_in_each_driver_generation(unit: str, driver: str) -> None:
    patterns = device_allow(unit)
    registered = {group.name for group in parse_proc_devices(PROC_DEVICES[driver])}
    for group in NEEDED[driver]:
        assert group in registered
        assert allowed(patterns, group), f"{unit} denies {group} of driver {driver}: DeviceAllow={patterns}"
    assert not allowed(patterns, "mem") and not allowed(patterns, "/dev/tty")


def test_the_old_device_names_deny_the_gpu_on_driver_580() -> None:
    # What the units allowed before: char-nvidia-frontend and friends match no group that driver 580 registers
    # for /dev/nvidia0 and /dev/nvidiactl, so vLLM's first CUDA call failed inside the unit.
    old = ["char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"]
    assert not allowed(old, "nvidia") and not allowed(old, "nvidiactl")
    assert allowed([NVIDIA_DEVICE_ALLOW], "nvidia") and allowed([NVIDIA_DEVICE_ALLOW], "nvidiactl")


def test_device_allow_patterns_are_globs_on_character_groups_only() -> None:
    assert matches("char-nvidia* rw", "nvidia-caps-imex-channels")
    assert matches("char-nvidia-uvm rw", "nvidia-uvm")
    assert not matches("char-nvidia-uvm rw", "nvidia-uvm-tools")
    assert not matches("block-nvidia* rw", "nvidia")
    assert not matches("/dev/nvidia0 rw", "nvidia")
    assert not matches("", "nvidia")


def test_proc_devices_yields_the_character_groups_not_the_block_ones() -> None:
    groups = parse_proc_devices(DRIVER_580)
    assert DeviceGroup(195, "nvidiactl") in groups
    assert DeviceGroup(1, "mem") in groups
    assert all(group.name not in ("sd", "blkext") for group in groups)


def test_this_machines_proc_devices_parses() -> None:
    groups = parse_proc_devices(Path("/proc/devices").read_text())
    assert DeviceGroup(1, "mem") in groups


def _denied(path: str, error: int) -> NodeAccess:
    return NodeAccess(Path(path), error, "root", "video", stat.S_IFCHR | 0o660)


def test_a_device_policy_refusal_names_the_registered_groups_and_the_drop_in_line() -> None:
    message = access_problem([_denied("/dev/nvidiactl", errno.EPERM)], parse_proc_devices(DRIVER_580), "gb10d", "gb10d@chat")
    assert message == (
        "cannot open /dev/nvidiactl (Operation not permitted): the service's device policy does not allow the NVIDIA "
        "devices, so vLLM's first CUDA call would fail. The driver registered these device groups in /proc/devices: "
        "nvidia (195), nvidiactl (195), nvidia-uvm (238), nvidia-nvswitch (239), nvidia-nvlink (240), nvidia-caps (241), "
        "nvidia-caps-imex-channels (242). Allow them with a drop-in: sudo systemctl edit gb10d@chat, add "
        "`DeviceAllow=char-nvidia* rw` under [Service], then: sudo systemctl restart gb10d@chat"
    )


def test_a_node_the_user_may_not_open_names_its_owner_mode_and_the_group_to_join() -> None:
    message = access_problem([NodeAccess(Path("/dev/nvidiactl"), None), _denied("/dev/nvidia-uvm", errno.EACCES)], [], "gb10d", "gb10d")
    assert message is not None
    assert message.startswith("cannot open /dev/nvidia-uvm (Permission denied): it is mode 0660, owned by root:video")
    assert "sudo usermod -aG video gb10d" in message


@pytest.mark.parametrize("error", [None, errno.ENXIO, errno.ENODEV, errno.EIO])
def test_only_refusals_stop_the_start(error: int | None) -> None:
    # A missing driver or a machine without a GPU is for vLLM to report; the check only knows refusals.
    assert access_problem([_denied("/dev/nvidiactl", error)] if error else [], [], "gb10d", "gb10d") is None


def test_no_nvidia_nodes_is_no_problem(tmp_path: Path) -> None:
    assert check_gpu_access("gb10d", paths=(tmp_path / "nvidiactl", tmp_path / "nvidia-uvm")) is None


@pytest.mark.parametrize(
    ("cgroup", "unit"),
    [
        ("0::/system.slice/gb10d.service\n", "gb10d"),
        ("0::/system.slice/system-gb10d.slice/gb10d@chat.service\n", "gb10d@chat"),
        ("12:pids:/system.slice/gb10d@emb.service\n0::/system.slice/gb10d@emb.service\n", "gb10d@emb"),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", "gb10d"),
    ],
)
def test_the_unit_is_named_after_the_cgroup_systemd_put_the_daemon_in(tmp_path: Path, cgroup: str, unit: str) -> None:
    path = tmp_path / "cgroup"
    path.write_text(cgroup)
    assert unit_name(path) == unit
    assert unit_name(tmp_path / "missing") == "gb10d"


DEVICES_V1 = Path("/sys/fs/cgroup/devices")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not (DEVICES_V1 / "devices.deny").exists(), reason="needs root and the cgroup v1 devices controller")
def test_a_node_the_kernels_device_cgroup_denies_is_reported_as_the_device_policy(tmp_path: Path) -> None:
    # The kernel's own device policy (what DevicePolicy=closed sets up) refuses a real character node
    # with the NVIDIA control device's major number; the check, run inside that cgroup, names the fix.
    node = tmp_path / "nvidiactl"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, 255))
    cgroup = DEVICES_V1 / f"gb10d-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        (cgroup / "devices.deny").write_text("c 195:* rwm")
        script = (
            "import os, sys\n"
            f"open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from pathlib import Path\n"
            "from gb10d.machine.devices import check_gpu_access\n"
            f"print(check_gpu_access('gb10d', paths=(Path({str(node)!r}),), proc_devices=Path('/proc/devices')))\n"
        )
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"cannot open {node} (Operation not permitted): the service's device policy does not allow"), result.stdout
        assert "`DeviceAllow=char-nvidia* rw`" in result.stdout
        # Outside that cgroup nothing refuses it (no driver answers: ENXIO), so nothing is reported.
        assert check_gpu_access("gb10d", paths=(node,)) is None
    finally:
        cgroup.rmdir()


def test_the_device_groups_seen_on_a_machine_with_driver_580_are_all_allowed_and_opened() -> None:
    # tests/gpu/check_devices.py, run on a machine with an NVIDIA GPU and driver 580.159.04 (not GB10: no systemd there).
    import json

    seen = json.loads((REPO / "tests" / "fixtures" / "gpu-devices-580" / "devices.json").read_text())
    names = {name for _, name in seen["nvidia_groups"]}
    assert {"nvidia", "nvidiactl", "nvidia-uvm"} <= names and "nvidia-frontend" not in names
    for unit in ("gb10d.service", "gb10d@.service"):
        assert all(allowed(device_allow(unit), name) for name in names), unit
    assert seen["check_as_root"] is None and seen["check_as_nobody"] == "None"
    assert [path for path, error, *_ in seen["nodes"] if error is None] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"]
    assert "NVIDIA driver 580.159.04" in seen["host"]
