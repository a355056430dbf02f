"""gb10d.sim: a stand-in for `vllm serve` that behaves like vLLM 0.23-0.34 without a GPU.

It prints vLLM's lines byte for byte on the same streams, runs an API-server
process and a separate `VLLM::EngineCore` process in the same process group,
binds the port early and listens only once uvicorn would, serves vLLM's HTTP
routes, and fails exactly as vLLM fails. gb10d supervises it exactly as it
supervises vLLM; tests and `gb10d demo` use it where no GPU is at hand.

Command line: `python -m gb10d.sim serve MODEL [vllm serve flags]`,
`python -m gb10d.sim make-venv DIR` (writes DIR/bin/vllm), `--version`.

Knobs (environment):
- `GB10D_SIM_ERA`: `0.30` (stream-wrapper tag on every physical line, as the
  recorded 0.23.0) or `0.31` (tag inside the log format only).
- `GB10D_SIM_VERSION`: the version printed and served (default 0.23.0, or
  0.31.0 with era 0.31); it selects the KV-cache and model-loading line forms.
- `GB10D_SIM_SCENARIO`: comma-separated `healthy`, `stall_at=K`,
  `slow_shards=S`, `cuda_oom_during=load|profile|graphs`, `kv_insufficient`,
  `engine_dies_after=S`, `hang_after=S`, `model_not_found`, `bad_parser`,
  `leak_gib=G`. A port in use is found by really binding it.
- `GB10D_SIM_SPEED`: factor on every delay (1: minutes, like a 27B model on
  GB10; 0.01: ready in about 1.5 s).
- `GB10D_SIM_SHARDS`: number of checkpoint shards (default 6, or the number
  of *.safetensors files when MODEL is a local folder).
- `GB10D_SIM_TOTAL_GIB` / `GB10D_SIM_FREE_GIB` (default 121.69 / 115), or
  `GB10D_SIM_MEMINFO`: a meminfo-format file whose MemTotal and MemFree are
  read at the moment of vLLM's free-memory check.
vLLM's own `VLLM_LOGGING_PREFIX`, `VLLM_CONFIGURE_LOGGING`,
`VLLM_LOGGING_LEVEL`, `VLLM_DISABLE_LOG_LOGO`, `VLLM_LOG_STATS_INTERVAL`,
`VLLM_API_KEY`, `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`, `NO_COLOR` and
`VLLM_LOGGING_COLOR` work as in vLLM.
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
