"""The NVIDIA driver's kernel messages that matter to a vLLM on GB10: its out-of-memory line and Xid errors.

Pure: `parse_kernel_line` reads one kernel log line, as journald's kernel
stream (`journalctl -k`, `MESSAGE=`), `dmesg` or a pasted log gives it, and
returns a `DriverOutOfMemory` or a `GpuXid` event, or None. `xid_meaning`
says what an Xid number means and what to do about it, from NVIDIA's Xid
catalog, for the numbers seen on GB10 and data-centre GPUs.

The driver's out-of-memory line comes before a whole-host freeze on GB10
(the GPU's memory is the host's), often while MemAvailable still looks
fine, so it is worth acting on at once; an Xid says the GPU or the driver
saw an error, and some (79: fallen off the bus) need a reboot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .events import DriverOutOfMemory, GpuXid

# `NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`; some drivers omit `PCI:`.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (?P<xid>\d+)(?:,\s*(?P<rest>.*))?"
)
# `NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from ...`
_DRIVER_OOM = re.compile(r"NVRM: (?P<rest>.*NV_ERR_NO_MEMORY.*)")
_DRIVER_OOM_BARE = re.compile(r"\S.*NV_ERR_NO_MEMORY.*")  # a paste whose wrapper took the `NVRM: ` with it


@dataclass(frozen=True)
class XidMeaning:
    """What an Xid number means, what to do, and whether only a reboot brings the GPU back (GB10 cannot reset its GPU alone)."""

    name: str
    meaning: str
    action: str
    reboot: bool
    serious: bool = True  # False: informational, not a cause of a failed start by itself


_RESTART = "restart vLLM; if it comes back with the same workload, the model's kernels or the driver are at fault"
XID_MEANINGS: dict[int, XidMeaning] = {
    13: XidMeaning("graphics engine exception", "a kernel hit an illegal instruction or an out-of-range address", _RESTART, False),
    31: XidMeaning("GPU memory page fault", "a kernel accessed memory it does not own", _RESTART, False),
    43: XidMeaning("GPU stopped processing", "the driver stopped a process's GPU work after a software fault; the GPU itself is fine", _RESTART, False),
    45: XidMeaning("preemptive cleanup", "the driver cleaned up the GPU work of a process that was stopped or failed before", "look for the error or the kill before it", False, False),
    48: XidMeaning("double-bit ECC error", "an uncorrectable memory error", "reboot the machine", True),
    61: XidMeaning("internal micro-controller breakpoint", "the GPU's firmware stopped at a breakpoint or warning", "reboot the machine if the GPU stops answering", True),
    62: XidMeaning("internal micro-controller halt", "the GPU's firmware halted", "reboot the machine", True),
    63: XidMeaning("ECC page retirement or row remapping", "a memory page was retired or a row remapped", "reboot at a convenient time for it to take effect", False, False),
    64: XidMeaning("ECC page retirement or row remapping failure", "retiring a bad memory page failed", "reboot the machine", True),
    68: XidMeaning("video decoder exception", "the NVDEC video decoder reported an error", _RESTART, False),
    74: XidMeaning("NVLink error", "an NVLink connection reported an error", "reboot the machine; if it repeats, have the hardware checked", True),
    79: XidMeaning("GPU has fallen off the bus", "the GPU no longer answers on its bus", "reboot the machine", True),
    92: XidMeaning("high single-bit ECC error rate", "corrected memory errors are frequent", "watch for more; have the hardware checked if they go on", False, False),
    94: XidMeaning("contained ECC error", "an uncorrectable memory error was contained to the process that used the memory", "restart vLLM", False),
    95: XidMeaning("uncontained ECC error", "an uncorrectable memory error that every process on the GPU may have seen", "reboot the machine", True),
    119: XidMeaning("GSP RPC timeout", "the GPU's system processor stopped answering the driver", "reboot the machine", True),
    120: XidMeaning("GSP error", "the GPU's system processor reported an error", "reboot the machine", True),
    # With `RmInitAdapter failed`: reported on Blackwell (GB10) under the proprietary kernel modules.
    169: XidMeaning(
        "GPU initialisation failed (RmInitAdapter)",
        "the driver could not initialise the GPU; Blackwell GPUs such as GB10's need NVIDIA's open kernel modules, and the "
        "proprietary ones fail this way",
        "install the open kernel modules of the same driver release (the -open driver package), then reboot the machine",
        True,
    ),
}


def xid_meaning(xid: int) -> XidMeaning:
    """The meaning of an Xid number; an unknown one points to NVIDIA's catalog."""
    return XID_MEANINGS.get(xid) or XidMeaning(
        f"Xid {xid}", "an error NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) explains",
        "look it up in that catalog; reboot if the GPU stops answering", False,
    )


def parse_kernel_line(text: str) -> DriverOutOfMemory | GpuXid | None:
    """The driver event in one kernel log line, wherever the line's prefix ends; None for any other line."""
    if "NVRM" not in text and "NV_ERR_" not in text:
        return None
    m = _XID.search(text)
    if m is not None:
        return GpuXid(xid=int(m.group("xid")), pci=m.group("pci"), detail=(m.group("rest") or "").strip())
    o = _DRIVER_OOM.search(text)
    if o is not None:
        return DriverOutOfMemory(detail=o.group("rest").strip())
    bare = _DRIVER_OOM_BARE.search(text)
    if bare is not None:
        return DriverOutOfMemory(detail=bare.group(0).strip())
    return None


def describe(event: DriverOutOfMemory | GpuXid) -> str:
    """One line for the journal: what the kernel said and what it means."""
    if isinstance(event, GpuXid):
        meaning = xid_meaning(event.xid)
        where = f" on {event.pci}" if event.pci else ""
        said = f" ({event.detail})" if event.detail else ""
        return f"NVIDIA Xid {event.xid}{where}, {meaning.name}: {meaning.meaning}{said}"
    return f"the NVIDIA driver ran out of memory ({event.detail})"
