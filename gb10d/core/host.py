"""Facts about this machine that decide how GB10's own failures are handled, and the known-bad combinations.

At each start gb10d notes the kernel, the NVIDIA driver version, the CMA
figures of /proc/meminfo and whether a CUDA toolkit's ptxas that knows
GB10's GPU is installed. They go to the journal and `gb10d status`, they
let the policy fix Triton's ptxas failure (TRITON_PTXAS_PATH) only when
there is a ptxas to point at, and they are checked against combinations
reported to fail, kept as data in `KNOWN_BAD` so that a new report is one
more entry.

Everything here is pure: `gb10d.machine.host` reads the files and runs
`ptxas --version`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from .memory import meminfo_fields

# sm_121a first appeared in the CUDA 12.9 toolkit's ptxas.
PTXAS_MIN_RELEASE = (12, 9)

_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_DRIVER = re.compile(r"NVRM version: .*?\s(\d+\.\d+(?:\.\d+)?)\s")


@dataclass(frozen=True)
class HostFacts:
    """This machine as gb10d sees it; None where the source is missing (no NVIDIA driver, no CMA)."""

    kernel: str
    driver: str | None = None
    cma_total_kib: int | None = None
    cma_free_kib: int | None = None
    ptxas: str | None = None  # a ptxas that knows sm_121a, for TRITON_PTXAS_PATH
    open_modules: bool | None = None  # the driver's kernel modules are NVIDIA's open ones (None: no driver loaded)

    def summary(self) -> str:
        """`kernel 6.17.0-1008-nvidia, NVIDIA driver 580.95.05, CMA 1024 MiB total, 992 MiB free, ptxas /usr/local/cuda/bin/ptxas`."""
        modules = {True: " (open kernel modules)", False: " (proprietary kernel modules)", None: ""}[self.open_modules]
        parts = [f"kernel {self.kernel}", f"NVIDIA driver {self.driver}{modules}" if self.driver else "no NVIDIA driver loaded"]
        if self.cma_total_kib is not None and self.cma_free_kib is not None:
            parts.append(f"CMA {self.cma_total_kib // 1024} MiB total, {self.cma_free_kib // 1024} MiB free")
        parts.append(f"ptxas {self.ptxas}" if self.ptxas else "no CUDA toolkit ptxas found")
        return ", ".join(parts)


@dataclass(frozen=True)
class KnownBad:
    """A combination of kernel, driver and memory figures reported to fail, and what to do about it."""

    name: str
    applies: Callable[[HostFacts], bool]
    problem: str
    fix: str


def _kho_regression(facts: HostFacts) -> bool:
    cma_inverted = facts.cma_free_kib is not None and facts.cma_total_kib is not None and facts.cma_free_kib > facts.cma_total_kib
    return cma_inverted and re.match(r"7\.0\.0-10\d\d-nvidia", facts.kernel) is not None


KNOWN_BAD: tuple[KnownBad, ...] = (
    KnownBad(
        "kho",
        _kho_regression,
        "CmaFree is above CmaTotal on a 7.0.0-10xx-nvidia kernel: the kexec-handover (KHO) regression, with which "
        "NCCL between two machines fails (ibv_reg_mr_iova2 failed with error Cannot allocate memory)",
        "boot with kho=off (add it to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot)",
    ),
    KnownBad(
        "proprietary_modules",
        lambda facts: facts.open_modules is False,
        "the NVIDIA driver runs its proprietary kernel modules; Blackwell GPUs such as GB10's need the open ones, and fail "
        "to initialise with the others (Xid 169, RmInitAdapter failed)",
        "install the open kernel modules of the same driver release (the -open driver package), then reboot",
    ),
)


def warnings(facts: HostFacts) -> list[str]:
    """One sentence per known-bad combination this machine is in: the problem, then the fix."""
    return [f"{bad.problem}; {bad.fix}" for bad in KNOWN_BAD if bad.applies(facts)]


def open_modules(text: str) -> bool | None:
    """Whether /proc/driver/nvidia/version names the open kernel modules (`NVIDIA UNIX Open Kernel Module for ...`)
    or the proprietary ones (`NVIDIA UNIX aarch64 Kernel Module ...`); None when it names neither."""
    if "Open Kernel Module" in text:
        return True
    return False if "Kernel Module" in text else None


def driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version (`NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  ...`)."""
    m = _DRIVER.search(text)
    return m.group(1) if m else None


def cma(meminfo: str) -> tuple[int | None, int | None]:
    """CmaTotal and CmaFree of a /proc/meminfo text, in KiB (None where absent)."""
    fields = meminfo_fields(meminfo)
    total, free = fields.get("CmaTotal"), fields.get("CmaFree")
    return (total // 1024 if total is not None else None), (free // 1024 if free is not None else None)


def ptxas_release(version_output: str) -> tuple[int, int] | None:
    """The CUDA release `ptxas --version` names (`Cuda compilation tools, release 13.0, V13.0.48`)."""
    m = _RELEASE.search(version_output)
    return (int(m.group(1)), int(m.group(2))) if m else None


def ptxas_candidates(env: Mapping[str, str]) -> list[Path]:
    """Where a CUDA toolkit's ptxas may be, in the order looked at: CUDA_HOME and CUDA_PATH of vLLM's
    environment, /usr/local/cuda, then vLLM's PATH."""
    candidates = [Path(env[name]) / "bin" / "ptxas" for name in ("CUDA_HOME", "CUDA_PATH") if env.get(name)]
    candidates.append(Path("/usr/local/cuda/bin/ptxas"))
    candidates += [Path(d) / "ptxas" for d in env.get("PATH", "").split(os.pathsep) if d]
    return candidates
