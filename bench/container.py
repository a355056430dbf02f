"""Item 7: vLLM in a container next to the venv: readiness latency, the start's cost, and stop time.

The same stand-in at the same speed runs under the real `gb10d run` three
ways: from a venv (a process group of gb10d's own), and as the `vllm` of an
image built from this tree (tests/containers.py builds it: this Python, the
gb10d package, the stand-in as `vllm`) under docker and under rootful
podman, each engine where it answers. Per start:

- readiness latency, as item 1 measures it: from the forwarded
  `Application startup complete.` line to READY=1. gb10d's probes reach the
  container's port on the host's network, so this should not differ;
- the start's cost: from `gb10d run` to vLLM's first forwarded line (for a
  container: the engine creates it and its init runs `vllm`);
- stop time, as item 6: from SIGTERM to gb10d until gb10d has exited with
  nothing left (for a container: stopped through the engine and removed,
  which the engine is asked afterwards).

The three ways alternate start by start, so load drift hits them alike.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from gb10d.base.command import Engine, EngineKind, engine_client
from gb10d.launch.engine import probe

from .lab import Deployment, Gb10d, Workspace, summary

SPEED = 0.01
STARTUP_LINE = r"Application startup complete\."
FIRST_VLLM_LINE = r"^<\d>(?!gb10d: )"  # the first line gb10d forwards rather than says
TESTS = Path(__file__).resolve().parent.parent / "tests"


def engines() -> tuple[list[Engine], dict[str, str]]:
    """The engines that answer here, and why each other one is left out."""
    found: list[Engine] = []
    missing: dict[str, str] = {}
    kinds: tuple[EngineKind, ...] = ("docker", "podman")
    for kind in kinds:
        engine = engine_client(kind, None, as_root=os.geteuid() == 0)
        problem = probe(engine)
        if problem is None:
            found.append(engine)
        else:
            missing[kind] = str(problem)
    return found, missing


def sim_image(engine: Engine) -> str:
    """The stand-in's image in this engine, built by the tests' builder if this tree's is missing."""
    sys.path.insert(0, str(TESTS))
    try:
        from containers import ensure_sim_image

        return ensure_sim_image(engine)
    finally:
        sys.path.remove(str(TESTS))


def deployment(ws: Workspace, engine: Engine | None, image: str | None) -> Deployment:
    """The same deployment as a venv or in a container (an empty model directory mounted where the venv's path leads nowhere)."""
    directory = ws.scratch(engine.kind if engine else "venv")
    if engine is None or image is None:
        return Deployment(directory, ws.venv, sim_env={"GB10D_SIM_SPEED": str(SPEED)}, overrides={"startup.warmup": False})
    sys.path.insert(0, str(TESTS))
    try:
        from containers import run_args_for
    finally:
        sys.path.remove(str(TESTS))
    (directory / "model").mkdir()
    container = {
        "engine": engine.kind, "gpu": "none", "pull": "never", "cache_dir": str(directory / "cache"),
        "name": f"gb10d-bench-{os.getpid()}-{directory.name}", "run_args": run_args_for(engine.kind),
        "mounts": [f"{directory}/model:/srv/models/tiny-llama:ro", f"{directory}:{directory}"],
    }
    return Deployment(directory, None, sim_env={"GB10D_SIM_SPEED": str(SPEED)}, overrides={"startup.warmup": False},
                      image=image, container=container)


def one_start(dep: Deployment, engine: Engine | None) -> dict[str, float]:
    """Start, wait for READY=1, stop; the three figures of one run."""
    name = dep.container.get("name")
    try:
        with Gb10d(dep) as gb:
            first = gb.wait_line(FIRST_VLLM_LINE, 120)
            line = gb.wait_line(STARTUP_LINE, 120)
            ready_at = gb.wait_ready(120)
            if first is None or line is None:
                raise RuntimeError("gb10d forwarded no vLLM output:\n" + gb.tail())
            sent = time.monotonic()
            gb.terminate()
            if gb.wait_exit(120) != 0:
                raise RuntimeError("gb10d did not stop cleanly:\n" + gb.tail())
            gone = time.monotonic()
            if engine is not None and _exists(engine, str(name)):
                raise RuntimeError(f"the container {name} is still there after gb10d stopped")
            return {"ready_s": ready_at - line[0], "to_first_line_s": first[0] - gb.started_at, "stop_s": gone - sent}
    finally:
        if engine is not None:
            _remove(engine, str(name))


def _exists(engine: Engine, name: str) -> bool:
    import subprocess

    return subprocess.run([*engine.client, "container", "inspect", name], capture_output=True, timeout=60).returncode == 0


def _remove(engine: Engine, name: str) -> None:
    import subprocess

    subprocess.run([*engine.client, "rm", "--force", name], capture_output=True, timeout=60)


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """Alternating starts of the venv and each engine that answers."""
    repeats = 2 if quick else 5
    found, missing = engines()
    ways: list[tuple[str, Engine | None, str | None]] = [("venv", None, None)]
    ways += [(engine.kind, engine, sim_image(engine)) for engine in found]
    samples: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in ways}
    for _ in range(repeats):
        for label, engine, image in ways:
            samples[label].append(one_start(deployment(ws, engine, image), engine))
    result: dict[str, Any] = {"sim_speed": SPEED, "repeats": repeats, "skipped": missing, "ways": {}}
    for label, values in samples.items():
        result["ways"][label] = {key: summary([v[key] for v in values]) for key in ("ready_s", "to_first_line_s", "stop_s")}
    return result
