"""gb10d.sim: a stand-in for `vllm serve` that behaves like vLLM 0.23-0.34 without a GPU.

It prints vLLM's lines byte for byte on the same streams, runs an API-server
process and a separate `VLLM::EngineCore` process in the same process group,
binds the port early and listens only once uvicorn would, serves vLLM's HTTP
routes, and fails exactly as vLLM fails. gb10d supervises it exactly as it
supervises vLLM; tests and `gb10d demo` use it where no GPU is at hand.

Command line: `python -m gb10d.sim serve MODEL [vllm serve flags]`,
`python -m gb10d.sim make-venv DIR` (writes DIR/bin/vllm, DIR/bin/ray,
DIR/bin/python and python3, as a vLLM virtualenv has them), `--version`.

Knobs (environment):
- `GB10D_SIM_ERA`: `0.30` (stream-wrapper tag on every physical line, as the
  recorded 0.23.0) or `0.31` (tag inside the log format only).
- `GB10D_SIM_VERSION`: the version printed and served (default 0.23.0, or
  0.31.0 with era 0.31); it selects the KV-cache and model-loading line forms,
  and 0.34's extensible KV cache: on unless `--no-enable-extensible-kv-cache`
  or `--kv-cache-memory-bytes`, it skips the free-memory check at the start
  and sizes the KV cache from what is free after the load (MemFree), within
  the utilization (default 1.0 with it), failing with 0.34's hints.
- `GB10D_SIM_SCENARIO`: comma-separated `healthy`, `stall_at=K`,
  `slow_shards=S`, `cuda_oom_during=load|profile|graphs`, `kv_insufficient`,
  `engine_dies_after=S`, `hang_after=S`, `model_not_found`, `bad_parser`,
  `leak_gib=G`, `page_cache_gib=G` (the load leaves G GiB of the checkpoint
  in the page cache: MemFree falls, MemAvailable does not; allocations
  reclaim it, and it is dropped when the engine ends, as gb10d's eviction
  of the model's pages would before the next start). A port in use is
  found by really binding it. GB10's own
  failures: `ptxas` (Triton's bundled ptxas does not know sm_121a: the start
  fails in torch.compile, or at the kernels' warm-up with --enforce-eager,
  unless TRITON_PTXAS_PATH names a ptxas that answers `--version` with its
  release, as Triton requires), `no_kernel_image` (the first kernel after the
  weights: a build without kernels for the GPU), `hidden_init_failure` (vLLM
  0.23 only: the EngineCore dies without a word and the API server says
  `Failed core proc(s): {}`), `ipc_removed` (the spawned EngineCore cannot
  open its parent's semaphore: FileNotFoundError in SemLock._rebuild),
  `bad_wake` (with --enable-sleep-mode: reload_weights answers and logs as
  usual but the weights stay garbage, so a woken engine answers 200 with
  empty text, as vllm#49237 reports).
- `GB10D_SIM_LOAD_GATE`: a path; the weights' load waits before its first
  shard until it exists (a test holds a start there for as long as it needs).
- `GB10D_SIM_SPEED`: factor on every delay (1: minutes, like a 27B model on
  GB10; 0.01: ready in about 1.5 s).
- `GB10D_SIM_SHARDS`: number of checkpoint shards (default 6, or the number
  of *.safetensors files when MODEL is a local folder).
- `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `HF_HOME` or `XDG_CACHE_HOME`
  (or `--download-dir`): the Hugging Face cache a repository id is looked up
  in, as huggingface_hub resolves it. A snapshot there loads silently; a miss
  prints huggingface_hub's download bars and vLLM's `Time spent downloading
  weights for ...` (shown, not stored); offline (`HF_HUB_OFFLINE`) a miss
  fails the start. With none of them set the model loads as from a warm
  cache (hub.py).
- `GB10D_SIM_TOTAL_GIB` / `GB10D_SIM_FREE_GIB` (default 121.69 / 115), or
  `GB10D_SIM_MEMINFO`: a meminfo-format file whose MemTotal and MemFree are
  read at the moment of vLLM's free-memory check, and in which the
  EngineCore holds its own memory as vLLM's shows in /proc/meminfo
  (memory.py): the weights shard by shard, the profile run, then the KV
  cache up to gpu_memory_utilization x MemTotal, all given back when it
  ends, kill -9 included. Several stand-ins on one file see each other;
  taking more than MemAvailable fails as CUDA does. Its directory must be
  writable (a lock file and an atomic replace). Not in Ray mode, whose
  workers hold their memory on their own machines.
  `GB10D_SIM_MEMINFO_HOLD=0` reads the file at the check but holds nothing
  in it: in a container the engine kills every process at once, the keeper
  that gives the memory back included, so what it held would stay taken.

Ray mode (`--distributed-executor-backend ray`, as vLLM across two GB10s):
the EngineCore becomes the driver of a real Ray cluster, `ray.init(address=
$RAY_ADDRESS or "auto")`, Ray's own lines included. World size = tensor x
pipeline parallel size; a cluster with fewer GPUs fails the start with
vLLM's `ValueError: The number of required GPUs exceeds the total number of
available GPUs in the placement group.`; otherwise one `{"GPU": 1}` bundle
per rank is placed (PACK, bundle 0 on the driver's node, VLLM_HOST_IP or
Ray's node IP; vLLM's "Waiting for creating a placement group" lines while
it cannot be placed) and one `RayWorkerWrapper` actor per rank (vLLM's
V1 Ray executor; 0.23 defaults to V2, whose `RayWorkerProc` actors tag
their lines differently and report a death from a monitor thread: see
docs/REAL_VLLM.md, the parser reads both) does the
per-GPU steps: process-group lines, the free-memory check, the weights
(rank 0 draws the shard bar). Their lines reach the sim's stdout/stderr
through Ray's log forwarding, `(RayWorkerWrapper pid=N[, ip=A]) ` in front
(and Ray's de-duplication of identical lines across workers, unless
RAY_DEDUP_LOGS=0). The memory knobs an actor uses are those of its own
machine, i.e. of the environment its `ray start` got; GB10D_SIM_SPEED,
_SCENARIO, _SHARDS, _ERA, _VERSION and every VLLM_* variable (less
VLLM_HOST_IP/_PORT) are copied from the driver. A worker's free-memory
failure is logged by the worker (`Error executing method 'init_device'`)
and ends the driver's traceback in `ray.exceptions.RayTaskError(ValueError)`;
a worker lost while serving (checked every second) ends the engine with
`EngineCore encountered a fatal error.` and the engine-death sequence.
Without an importable Ray the start fails with vLLM's `Failed to import Ray`.
The rest (compilation, KV sizing, graphs, serving) stays in the driver; see
ray_executor.py.

vLLM's own `VLLM_LOGGING_PREFIX`, `VLLM_CONFIGURE_LOGGING`,
`VLLM_LOGGING_LEVEL`, `VLLM_DISABLE_LOG_LOGO`, `VLLM_LOG_STATS_INTERVAL`,
`VLLM_API_KEY`, `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`, `NO_COLOR` and
`VLLM_LOGGING_COLOR` work as in vLLM.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# pip's launcher for a console script: /bin/sh runs the first two lines
# (exec of the interpreter with this file), Python reads them as a string.
_RAY_SCRIPT = """#!/bin/sh
'''exec' {python} "$0" "$@"
' '''
import sys
from ray.scripts.scripts import main

if __name__ == "__main__":
    sys.exit(main())
"""


def make_venv(directory: Path) -> Path:
    """Create `directory/bin/vllm`, `bin/ray`, `bin/python` and `bin/python3` as a vLLM virtualenv has them; returns the vllm path.

    `vllm` runs this interpreter's `-m gb10d.sim`; `ray` is the launcher pip
    writes for Ray's console script, so argv[0] is the script's path and the
    process reads `python DIR/bin/ray ...` as in a real virtualenv; `python` (and
    `python3`) exec this interpreter, so it imports gb10d and Ray. The interpreter path
    is baked in so the scripts work from any environment, and PYTHONPATH is
    left alone so the children see exactly the environment gb10d gives them.
    """
    bin_dir = Path(directory) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    python = shlex.quote(sys.executable)
    scripts = {
        "vllm": f'#!/bin/sh\nexec {python} -m gb10d.sim "$@"\n',
        "ray": _RAY_SCRIPT.format(python=python),
        "python": f'#!/bin/sh\nexec {python} "$@"\n',
    }
    scripts["python3"] = scripts["python"]
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)
    return bin_dir / "vllm"
