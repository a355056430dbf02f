"""Known failures of the GB10 platform, as data: how each shows in a log, what it means, the fix, whether a retry helps.

Pure. `logparse` turns a message into these issues' events with `match`;
`diagnose` names its verdicts after them; `advice` reads their fixes; the
supervisor can ask `issue_for(event)` whether starting again with the same
settings can help. To teach gb10d another platform failure, add an entry
here (and, if no event fits, an event class in `events`) and its failure
kind in `failures` (docs/DESIGN.md, "Adding a failure kind").

`needles` are plain substrings, checked first because `match` runs on every
line vLLM prints; a pattern's named groups fill the event's fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .events import (
    DriverOutOfMemory,
    Failure,
    GpuXid,
    HiddenInitFailure,
    IpcRemoved,
    PtxasArchUnsupported,
    RdmaRegistrationFailed,
    UnsupportedBuild,
)
from .kernel import parse_kernel_line


@dataclass(frozen=True)
class KnownIssue:
    """One known failure: its name (diagnose's verdict), its event, how it is recognised, and what to do."""

    name: str
    event: type[Failure]
    needles: tuple[str, ...]
    recognise: Callable[[str], Failure | None]
    meaning: str
    fix: str
    retry_helps: bool
    title: str  # a few words for lists (`gb10d diagnose --help`)


def _patterns(*rules: tuple[str, Callable[[re.Match[str], str], Failure]]) -> Callable[[str], Failure | None]:
    """A recogniser from (regex, build) rules tried in order; `build` gets the match and the whole message."""
    compiled = [(re.compile(pattern), build) for pattern, build in rules]

    def recognise(msg: str) -> Failure | None:
        for pattern, build in compiled:
            m = pattern.search(msg)
            if m is not None:
                return build(m, msg)
        return None

    return recognise


def _detail(msg: str) -> str:
    return msg.strip()[:300]


def _kernel(kind: type[DriverOutOfMemory] | type[GpuXid]) -> Callable[[str], Failure | None]:
    def recognise(msg: str) -> Failure | None:
        event = parse_kernel_line(msg)
        return event if isinstance(event, kind) else None
    return recognise


ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        "driver_oom", DriverOutOfMemory, ("NV_ERR_NO_MEMORY",), _kernel(DriverOutOfMemory),
        "the NVIDIA driver in the kernel ran out of memory; on GB10 a freeze of the whole machine can follow within "
        "seconds, with no OOM kill and nothing in the logs",
        "one such line alone is common in healthy starts on GB10, and gb10d stops vLLM only with evidence beside it "
        "(a burst of memory.driver_oom_burst lines, MemAvailable below memory.headroom_gib, a stalled load, an engine "
        "that stops answering); when it came with a failure, start vLLM again with a lower vllm.gpu_memory_utilization, with "
        'vllm.env.PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:False" and without --enable-flashinfer-autotune in '
        "vllm.args or vllm.extra_args (the workaround reported with this failure)",
        False,
        "the NVIDIA driver ran out of memory (kernel log)",
    ),
    KnownIssue(
        "gpu_xid", GpuXid, ("NVRM: Xid",), _kernel(GpuXid),
        "the NVIDIA driver reported an Xid error (journalctl -k shows it)",
        "see what the Xid number means (gb10d names it); a reboot is needed after Xid 79 (the GPU fell off the bus)",
        False,
        "an NVIDIA Xid error (kernel log)",
    ),
    KnownIssue(
        "unsupported_build", UnsupportedBuild,
        ("no kernel image", "NoKernelImage", "only supports sm", "UnsupportedPtxVersion", "unsupported toolchain"),
        _patterns(
            (r"no kernel image is available for execution on the device|cudaErrorNoKernelImageForDevice"
             r"|This kernel only supports sm_?\d+|cudaErrorUnsupportedPtxVersion"
             r"|the provided PTX was compiled with an unsupported toolchain",
             lambda m, msg: UnsupportedBuild(detail=_detail(msg))),
        ),
        "this vLLM or PyTorch build has no kernels for GB10's GPU (sm_121); no retry can help",
        "install builds made for CUDA 13 on aarch64 (pip install torch --index-url https://download.pytorch.org/whl/cu130, "
        "then vllm) in the venv vllm.venv names, or run NVIDIA's vLLM image (nvcr.io/nvidia/vllm)",
        False,
        "the vLLM or PyTorch build has no kernels for GB10's GPU",
    ),
    KnownIssue(
        "ptxas_sm121a", PtxasArchUnsupported, ("for option 'gpu-name'", "bin/ptxas"),
        _patterns(
            (r"Value '(?P<arch>sm_\w+)' is not defined for option 'gpu-name'",
             lambda m, msg: PtxasArchUnsupported(m.group("arch"), detail=_detail(msg))),
            # The repro command Triton prints with its PTXASError, when the error's own line was lost.
            (r"Repro command: \S*triton/backends/nvidia/bin/ptxas\S*\s.*--gpu-name[= ](?P<arch>sm_1[2-9]\d\w*)",
             lambda m, msg: PtxasArchUnsupported(m.group("arch"), detail=_detail(msg))),
        ),
        "the ptxas that Triton bundles is older than GB10's GPU (sm_121a) and cannot compile kernels for it",
        'point Triton at the CUDA 13 toolkit\'s ptxas: vllm.env.TRITON_PTXAS_PATH = "/usr/local/cuda/bin/ptxas" in '
        "gb10d.toml (install the CUDA 13 toolkit if that file is missing)",
        False,
        "Triton's bundled ptxas does not know sm_121a",
    ),
    KnownIssue(
        "nccl_kho", RdmaRegistrationFailed, ("ibv_reg_mr",),
        _patterns(
            (r"ibv_reg_mr\w* failed with error Cannot allocate memory",
             lambda m, msg: RdmaRegistrationFailed(detail=_detail(msg))),
        ),
        "NCCL could not register memory with the ConnectX-7 RDMA device: the kexec-handover (KHO) regression of "
        "7.0.0-10xx-nvidia kernels, which also shows CmaFree above CmaTotal in /proc/meminfo",
        "boot with kho=off (add it to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot); "
        "6.17 kernels are not affected",
        False,
        "NCCL cannot register RDMA memory (the kernel's KHO regression)",
    ),
    KnownIssue(
        "ipc_removed", IpcRemoved, ("SemLock._rebuild", "shared memory broadcast block"),
        _patterns(
            (r"SemLock\._rebuild", lambda m, msg: IpcRemoved(True, detail=_detail(msg))),
            (r"No available shared memory broadcast block found", lambda m, msg: IpcRemoved(False, detail=_detail(msg))),
        ),
        "vLLM's semaphores or shared memory were deleted under it: systemd-logind removes a regular user's IPC "
        "objects when that user's last session ends (RemoveIPC=yes)",
        "run vLLM as a system user (the gb10d service does), or set RemoveIPC=no in /etc/systemd/logind.conf, "
        "or keep the user's session with loginctl enable-linger USER",
        True,
        "vLLM's semaphores or shared memory were removed under it",
    ),
    KnownIssue(
        "hidden_init_failure", HiddenInitFailure, ("Failed core proc(s): {}",),
        _patterns((r"Failed core proc\(s\): \{\}", lambda m, msg: HiddenInitFailure())),
        "vLLM 0.23 ended the engine's start without printing why (vLLM 0.24 and later print the root cause)",
        "look for the engine's own error above; if there is none, upgrade vLLM to 0.24 or later to see it, "
        "and check that the engine's memory came back (gb10d status shows MemAvailable)",
        True,
        "vLLM 0.23's engine start failure with its cause hidden",
    ),
)

_BY_EVENT = {issue.event: issue for issue in ISSUES}
NEEDLES: tuple[str, ...] = tuple(needle for issue in ISSUES for needle in issue.needles)


def match(msg: str) -> list[Failure]:
    """The known issues' events in one message (usually none); only the issues whose needles occur are tried."""
    found: list[Failure] = []
    for issue in ISSUES:
        if any(needle in msg for needle in issue.needles):
            event = issue.recognise(msg)
            if event is not None:
                found.append(event)
    return found


def issue_for(event: Failure) -> KnownIssue | None:
    """The known issue an event reports, or None for the generic vLLM failures."""
    return _BY_EVENT.get(type(event))


def by_name(name: str) -> KnownIssue:
    """The known issue of that name (a diagnose verdict); KeyError for any other name."""
    for issue in ISSUES:
        if issue.name == name:
            return issue
    raise KeyError(name)
