"""This machine's facts read: the NVIDIA driver's version file, CMA in meminfo, and the CUDA toolkit's ptxas run.

What they mean (and the known-bad combinations) is decided in `gb10d.core.host`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping

from ..core.host import PTXAS_MIN_RELEASE, HostFacts, cma, driver_version, open_modules, ptxas_candidates, ptxas_release

DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def read_host_facts(meminfo_path: Path, vllm_env: Mapping[str, str], driver_path: Path = DRIVER_VERSION) -> HostFacts:
    """This machine's facts now; a source that cannot be read leaves its fact None."""
    try:
        text = driver_path.read_text(errors="replace")
    except OSError:
        text = ""
    driver = driver_version(text)
    try:
        total, free = cma(meminfo_path.read_text(errors="replace"))
    except OSError:
        total, free = None, None
    return HostFacts(os.uname().release, driver, total, free, _find_ptxas(vllm_env), open_modules(text) if driver else None)


def _find_ptxas(env: Mapping[str, str]) -> str | None:
    """The first candidate that runs and is new enough to know sm_121a."""
    for path in ptxas_candidates(env):
        if not (path.is_file() and os.access(path, os.X_OK)):
            continue
        try:
            result = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        release = ptxas_release(result.stdout)
        if release is not None and release >= PTXAS_MIN_RELEASE:
            return str(path)
    return None
