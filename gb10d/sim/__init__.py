"""gb10d.sim: a stand-in for `vllm serve` that behaves like vLLM 0.23-0.34 without a GPU.

It prints vLLM's lines byte for byte on the same streams, runs an API-server
process and a separate EngineCore process, binds the port early and listens
only once uvicorn would, serves vLLM's HTTP routes, and fails exactly as
vLLM fails (memory, KV cache, CUDA OOM, stalled shards, dead or hung
engine). gb10d supervises it exactly as it supervises vLLM. The knobs are
environment variables, see `settings.py`; `make_venv` gives a `bin/vllm`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def make_venv(directory: Path) -> Path:
    """Create `directory/bin/vllm`, running this interpreter's `-m gb10d.sim`; returns its path.

    The interpreter path is baked in so the script works from any
    environment, and PYTHONPATH is left alone so the child sees exactly the
    environment gb10d gives it.
    """
    bin_dir = Path(directory) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gb10d.sim "$@"\n', encoding="utf-8")
    vllm.chmod(0o755)
    return vllm
