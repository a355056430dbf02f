"""What a container start that did not reach vLLM means: the engine's refusal, and a container's exit status.

`docker run` and `podman run` exit 125, 126 or 127 both when the engine refuses the container (no GPU runtime, no
such image, a name in use) and when the image's program cannot run; only the container's start time tells them apart.
These are decisions about text and numbers the engine gave; gb10d.launch.container asks the engine and acts.
"""

from __future__ import annotations

import re
import signal

from ..base.command import Engine

# The exit statuses of a container client for an error of the engine itself, or a program it could not run.
ENGINE_STATUSES = (125, 126, 127)
# What `container inspect --format {{.State.StartedAt}}` shows for a container that never started.
NEVER_STARTED = "0001-01-01"


def refused_before_vllm(status: int, inspected: bool, started_at: str) -> bool:
    """Whether the engine refused the container before vLLM ran (its reason then is all the client printed).

    `inspected` says whether the engine could show the container at all; one it cannot show, or that never started,
    with an engine's exit status, was refused. Otherwise vLLM ran and exited at once: its own output tells why.
    """
    return status in ENGINE_STATUSES and (not inspected or started_at.startswith(NEVER_STARTED))


def run_failure(engine: Engine, image: str, text: str, status: int) -> str:
    """Why `ENGINE run` could not start the container, and what to do, from the client's stderr."""
    said = next((line.strip() for line in text.splitlines() if re.search(r"error", line, re.I)), text.strip().splitlines()[0] if text.strip() else f"exit status {status}")
    said = re.sub(r"^(?:docker|podman):\s*", "", said)
    tool = engine.kind
    if "could not select device driver" in text and "gpu" in text:
        advice = ("docker cannot give the container the GPU: install the NVIDIA Container Toolkit and register it "
                  "(sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker), or set container.gpu = \"cdi\"")
    elif "could not select device driver \"cdi\"" in text or "unresolvable CDI devices" in text:
        advice = ("there is no CDI description of the GPU: sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml "
                  "(again after every driver update)")
    elif "executable file not found" in text:
        advice = f"the image {image} has no vllm program on its PATH; is it a vLLM image?"
    elif "No such image" in text or "image not known" in text:
        advice = f"the image {image} is not present; set container.pull = \"missing\" or load it ({tool} pull {image})"
    elif "already in use" in text:
        advice = f"another container has the name gb10d wants; remove it ({tool} rm -f NAME) or set container.name"
    elif "rlimit" in text:
        advice = f"{tool} may not set the container's resource limits here; give them in container.run_args (--ulimit NAME=SOFT:HARD)"
    else:
        advice = f"try the command by hand: gb10d print-command (it prints the exact {tool} run)"
    return f"{tool} could not start the container of {image}: {said}; {advice}"


def signal_status(status: int) -> int:
    """A container's exit status as gb10d reports a process's: 128+N (as engines and init report a signal) is -N."""
    if 128 < status < 128 + 65:
        try:
            return -signal.Signals(status - 128)
        except ValueError:
            return status
    return status
