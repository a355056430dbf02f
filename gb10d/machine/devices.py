"""Whether vLLM will be able to open the NVIDIA devices, and what to say when it will not.

The unit runs with `DevicePolicy=closed`, so vLLM reaches only the device
groups its `DeviceAllow=` lines name. systemd matches those names (shell
globs) against the character device groups in /proc/devices, and the NVIDIA
driver renamed its groups in 550.40 (`nvidia-frontend` became `nvidia` and
`nvidiactl`). A unit that names a group the driver does not register denies
the device silently, and vLLM then fails with a CUDA error far from the
cause. gb10d therefore opens the two nodes every CUDA process needs before
it starts vLLM, and on a refusal names what the driver registered and the
line that allows it.

`parse_proc_devices`, `matches` and `access_problem` are pure; `probe_nodes`
and `check_gpu_access` do the opening.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .access import group_name, user_name

# Every CUDA process opens the control device and the unified-memory device first.
NVIDIA_NODES = (Path("/dev/nvidiactl"), Path("/dev/nvidia-uvm"))
PROC_DEVICES = Path("/proc/devices")
# The DeviceAllow= line the units ship, and the one gb10d suggests.
NVIDIA_DEVICE_ALLOW = "char-nvidia* rw"


@dataclass(frozen=True)
class DeviceGroup:
    """One character device group of /proc/devices: `195 nvidiactl`."""

    major: int
    name: str


@dataclass(frozen=True)
class NodeAccess:
    """What opening one device node read-write gave: None, or the errno, and the node's owner and mode."""

    path: Path
    error: int | None
    owner: str = ""
    group: str = ""
    mode: int = 0


def parse_proc_devices(text: str) -> list[DeviceGroup]:
    """The character device groups of a /proc/devices text (the block devices after them are left out)."""
    groups: list[DeviceGroup] = []
    in_character = False
    for line in text.splitlines():
        line = line.strip()
        if line.endswith(":"):
            in_character = line == "Character devices:"
            continue
        major, _, name = line.partition(" ")
        if in_character and major.isdigit() and name:
            groups.append(DeviceGroup(int(major), name.strip()))
    return groups


def matches(device_allow: str, group: str) -> bool:
    """Whether a `DeviceAllow=char-PATTERN ...` value allows the character device group `group`.

    systemd compares the part after `char-` with each name in /proc/devices
    as a shell glob (fnmatch), so `char-nvidia*` covers every NVIDIA group.
    """
    spec = device_allow.split()[0] if device_allow.split() else ""
    if not spec.startswith("char-"):
        return False
    return fnmatch.fnmatchcase(group, spec[len("char-") :])


def access_problem(nodes: list[NodeAccess], groups: list[DeviceGroup], user: str, unit: str) -> str | None:
    """Why vLLM could not open the NVIDIA devices, with the fix; None when nothing stands in the way.

    Only refusals count: EPERM is the device policy (a cgroup denies the
    major number), EACCES the node's owner and mode. A node that is missing
    or whose driver is not loaded is vLLM's to report; the check does not
    guess about a machine without a GPU.
    """
    for node in nodes:
        if node.error == errno.EPERM:
            nvidia = [g for g in groups if g.name.startswith("nvidia")]
            registered = ", ".join(f"{g.name} ({g.major})" for g in nvidia) or "none named nvidia*"
            return (
                f"cannot open {node.path} ({os.strerror(node.error)}): the service's device policy does not allow the "
                f"NVIDIA devices, so vLLM's first CUDA call would fail. The driver registered these device groups in "
                f"/proc/devices: {registered}. Allow them with a drop-in: sudo systemctl edit {unit}, add "
                f"`DeviceAllow={NVIDIA_DEVICE_ALLOW}` under [Service], then: sudo systemctl restart {unit}"
            )
        if node.error == errno.EACCES:
            return (
                f"cannot open {node.path} ({os.strerror(node.error)}): it is mode {stat.S_IMODE(node.mode):04o}, owned by "
                f"{node.owner}:{node.group}, and the user {user} may not read and write it, so vLLM's first CUDA call "
                f"would fail. Add the user to that group (sudo usermod -aG {node.group} {user}) or make the node "
                "world-readable and writable as the NVIDIA driver does by default (NVreg_DeviceFileMode=0666)"
            )
    return None


def probe_nodes(paths: tuple[Path, ...] = NVIDIA_NODES) -> list[NodeAccess]:
    """Open each existing node read-write, as CUDA does, and close it again; missing nodes are skipped."""
    found: list[NodeAccess] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            continue
        error: int | None = None
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
        except OSError as exc:
            error = exc.errno
        found.append(NodeAccess(path, error, user_name(st.st_uid), group_name(st.st_gid), st.st_mode))
    return found


def check_gpu_access(unit: str, paths: tuple[Path, ...] = NVIDIA_NODES, proc_devices: Path = PROC_DEVICES) -> str | None:
    """`access_problem` for this process and machine: the message, or None when vLLM can open the devices."""
    nodes = probe_nodes(paths)
    if all(node.error is None for node in nodes):
        return None
    try:
        groups = parse_proc_devices(proc_devices.read_text())
    except OSError:
        groups = []
    return access_problem(nodes, groups, user_name(os.geteuid()), unit)
