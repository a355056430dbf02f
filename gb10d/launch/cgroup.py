"""A container's cgroup as this machine mounts it: where its processes are listed and where its I/O is counted.

Apart from the container because it is how a container's progress is seen:
the gb10d user cannot read /proc/PID/io of the container's processes (they
belong to root), so the I/O that shows a silent load is alive is read from
the cgroup files instead, on cgroup v1 and v2 alike. Reading the files'
text is pure (the functions at the top); ContainerCgroup reads the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


def cgroup_mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """Where each cgroup hierarchy is mounted, and the cgroup path at its root, from /proc/self/mountinfo.

    Keys are v1 controller names (`blkio`, `memory`, ...) and `unified` for
    the v2 hierarchy (all of /sys/fs/cgroup on cgroup v2, /sys/fs/cgroup/unified
    on a hybrid host).
    """
    mounts: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        root, point = fields[3], Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            mounts.setdefault("unified", (point, root))
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("blkio", "memory", "pids", "cpu", "cpuacct") or option.startswith("name="):
                    mounts.setdefault(option, (point, root))
    return mounts


def cgroup_dir(proc_cgroup: str, mounts: Mapping[str, tuple[Path, str]], hierarchy: str) -> Path | None:
    """The directory of a process's cgroup in one hierarchy (`unified`, `blkio`, `memory`); None when not visible here."""
    if hierarchy not in mounts:
        return None
    point, root = mounts[hierarchy]
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (hierarchy == "unified" and number == "0" and controllers == "") or hierarchy in controllers.split(","):
            relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
            if relative.startswith(".."):
                return None  # outside the part of the tree this mount shows (another cgroup namespace)
            return point / relative if relative != "." else point
    return None


def io_stat_bytes(text: str) -> int:
    """Bytes read and written, summed over devices, from cgroup v2 `io.stat`."""
    total = 0
    for line in text.splitlines():
        for field in line.split()[1:]:
            name, _, value = field.partition("=")
            if name in ("rbytes", "wbytes") and value.isdigit():
                total += int(value)
    return total


def blkio_bytes(text: str) -> int:
    """Bytes read and written from cgroup v1 `blkio.throttle.io_service_bytes` (the per-device Read and Write lines)."""
    total = 0
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in ("Read", "Write") and fields[2].isdigit():
            total += int(fields[2])
    return total


def paged_in_bytes(memory_stat: str, page_size: int) -> int:
    """Bytes of pages brought into the container's memory cgroup (v1 `memory.stat` total_pgpgin, else pgpgin)."""
    values = dict(line.split()[:2] for line in memory_stat.splitlines() if len(line.split()) >= 2)
    pages = values.get("total_pgpgin") or values.get("pgpgin") or "0"
    return int(pages) * page_size if pages.isdigit() else 0


@dataclass(frozen=True)
class ContainerCgroup:
    """The cgroup files of a running container, as this machine mounts them.

    cgroup v2 counts block I/O per cgroup in io.stat. cgroup v1's blkio
    counts it only for devices with a throttle limit on recent kernels, so
    on v1 the pages the container's memory cgroup took in (a file read from
    disk, an mmap fault, new memory) count as well: a loader that reads moves
    that count, a hung one does not.
    """

    procs_dir: Path
    io_stat: Path | None = None
    blkio: Path | None = None
    memory_stat: Path | None = None

    @classmethod
    def of(cls, pid: int, container_id: str) -> ContainerCgroup | None:
        """The cgroup of the container `container_id` whose process is `pid` on the engine's host; None when it cannot be seen from here.

        The engine names a pid of its own host's pid namespace. Where gb10d
        runs in another one (a booted container that reaches the host's
        engine through its socket), the same number is some other process
        or none: only a cgroup that names the container's id is its own.
        """
        try:
            proc_cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            mounts = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        except OSError:
            return None
        if not container_id or container_id not in proc_cgroup:
            return None
        return cgroup_files(proc_cgroup, mounts)

    def io_bytes(self) -> int | None:
        """The I/O count of the container so far; None when no file of it can be read (the container is gone)."""
        page = os.sysconf("SC_PAGE_SIZE")
        readings: list[int] = []
        for path, parse in ((self.io_stat, io_stat_bytes), (self.blkio, blkio_bytes), (self.memory_stat, lambda t: paged_in_bytes(t, page))):
            if path is None:
                continue
            try:
                readings.append(parse(path.read_text()))
            except OSError:
                continue
        return sum(readings) if readings else None

    def procs(self) -> list[int]:
        """The pids of the container's processes (host pids), empty once it is gone."""
        try:
            return [int(pid) for pid in (self.procs_dir / "cgroup.procs").read_text().split()]
        except OSError:
            return []


def cgroup_files(proc_cgroup: str, mounts: Mapping[str, tuple[Path, str]]) -> ContainerCgroup | None:
    """Which files count a process's cgroup: io.stat on cgroup v2, blkio and memory.stat where v1 controllers are mounted."""
    blkio, memory = cgroup_dir(proc_cgroup, mounts, "blkio"), cgroup_dir(proc_cgroup, mounts, "memory")
    if blkio is None and memory is None:
        unified = cgroup_dir(proc_cgroup, mounts, "unified")
        return ContainerCgroup(unified, io_stat=unified / "io.stat") if unified is not None else None
    return ContainerCgroup(
        memory or blkio,  # type: ignore[arg-type]  # one of them is set
        blkio=blkio / "blkio.throttle.io_service_bytes_recursive" if blkio is not None else None,
        memory_stat=memory / "memory.stat" if memory is not None else None,
    )
