"""kernel: the NVIDIA driver's out-of-memory line and Xid errors, as journald's kernel stream, dmesg or a paste gives them."""

from __future__ import annotations

import pytest

from gb10d.vllm.events import DriverOutOfMemory, GpuXid
from gb10d.vllm.kernel import XID_MEANINGS, describe, parse_kernel_line, xid_meaning

OOM = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
       "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
XID79 = "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (XID79, GpuXid(xid=79, pci="0000:01:00", detail="pid=1234, name=python3, GPU has fallen off the bus.")),
        ("[  812.004512] NVRM: Xid (PCI:000f:01:00): 13, pid=4100, name=VLLM::EngineCor, Graphics SM Warp Exception",
         GpuXid(xid=13, pci="000f:01:00", detail="pid=4100, name=VLLM::EngineCor, Graphics SM Warp Exception")),
        ("Dec 04 13:10:00 spark kernel: NVRM: Xid (0000:01:00.0): 31, pid='<unknown>', name=<unknown>, Ch 00000008",
         GpuXid(xid=31, pci="0000:01:00.0", detail="pid='<unknown>', name=<unknown>, Ch 00000008")),
        ("NVRM: Xid (PCI:0000:01:00): 119", GpuXid(xid=119, pci="0000:01:00")),
        (OOM, DriverOutOfMemory(detail=OOM.removeprefix("NVRM: "))),
        ("<3>[ 5123.447] " + OOM, DriverOutOfMemory(detail=OOM.removeprefix("NVRM: "))),
        ("NVRM: loading NVIDIA UNIX Open Kernel Module for aarch64  580.95.05", None),
        ("nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver", None),
        ("Out of memory: Killed process 48213 (VLLM::EngineCor)", None),
    ],
)
def test_kernel_lines_give_their_driver_events(line: str, expected: DriverOutOfMemory | GpuXid | None) -> None:
    assert parse_kernel_line(line) == expected


@pytest.mark.parametrize(
    ("xid", "reboot", "serious"),
    [(13, False, True), (31, False, True), (43, False, True), (45, False, False), (48, True, True), (61, True, True),
     (62, True, True), (63, False, False), (64, True, True), (68, False, True), (74, True, True), (79, True, True),
     (92, False, False), (94, False, True), (95, True, True), (119, True, True), (120, True, True), (169, True, True)],
)
def test_every_common_xid_has_a_meaning_and_says_whether_only_a_reboot_helps(xid: int, reboot: bool, serious: bool) -> None:
    meaning = xid_meaning(xid)
    assert (meaning.reboot, meaning.serious) == (reboot, serious)
    assert meaning.name and meaning.meaning and meaning.action
    assert ("reboot" in meaning.action) if reboot else True


def test_the_table_holds_exactly_the_numbers_it_documents() -> None:
    assert sorted(XID_MEANINGS) == [13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 74, 79, 92, 94, 95, 119, 120, 169]


def test_xid_169_names_the_open_kernel_modules_blackwell_needs() -> None:
    event = parse_kernel_line("NVRM: Xid (PCI:000f:01:00): 169, pid='<unknown>', name=<unknown>, RmInitAdapter failed! (0x24:0x72:1568)")
    assert event == GpuXid(xid=169, pci="000f:01:00", detail="pid='<unknown>', name=<unknown>, RmInitAdapter failed! (0x24:0x72:1568)")
    meaning = xid_meaning(169)
    assert "open kernel modules" in meaning.meaning and "-open driver package" in meaning.action and meaning.reboot


def test_an_unknown_xid_points_to_nvidias_catalog() -> None:
    meaning = xid_meaning(154)
    assert meaning.name == "Xid 154" and "docs.nvidia.com/deploy/xid-errors" in meaning.meaning and not meaning.reboot


def test_a_journal_line_names_the_number_its_meaning_and_what_the_driver_said() -> None:
    event = parse_kernel_line(XID79)
    assert isinstance(event, GpuXid)
    assert describe(event) == ("NVIDIA Xid 79 on 0000:01:00, GPU has fallen off the bus: the GPU no longer answers on its bus "
                               "(pid=1234, name=python3, GPU has fallen off the bus.)")
    oom = parse_kernel_line(OOM)
    assert isinstance(oom, DriverOutOfMemory) and describe(oom).startswith("the NVIDIA driver ran out of memory (nvCheckOkFailedNoLog: Check failed")
