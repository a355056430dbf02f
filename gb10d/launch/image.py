"""The image a container starts from, on the engine: inspected, and pulled as `container.pull` says, with its progress told.

Apart from the container of one attempt because it runs once per sequence
of starts, before any container (daemon.pull drives it as a task), and
reads the client through a pseudo-terminal: only there do docker and podman
print the byte counts that tell a slow pull from a stalled one.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
from typing import Callable, Mapping

from ..base.command import Engine
from ..base.image import ImageInfo, PreparedImage, PullProgress, PullState, advance_pull, image_info, not_present, pull_failure, pull_lines
from .engine import EngineUnavailable, engine_call, kill_group, not_installed, running_user, unreachable_advice, unreachable_error

# A pull's output is kept up to this size for the failure message.
_PULL_OUTPUT_CAP = 1 << 16
ProgressHandler = Callable[[PullProgress], None]


async def inspect_image(engine: Engine, reference: str, env: Mapping[str, str] | None = None) -> ImageInfo | None:
    """The local image `reference` names, or None when it is not present."""
    result = await engine_call(engine, "image", "inspect", reference, env=env)
    if result.status != 0:
        if re.search(r"No such image|image not known|failed to find image", result.stderr, re.I):
            return None
        raise unreachable_error(engine, result, "image inspect")
    found = json.loads(result.stdout)[0]
    return image_info(reference, str(found.get("Id", "")), list(found.get("RepoDigests") or []), found.get("Digest"))


async def pull(engine: Engine, reference: str, on_progress: ProgressHandler, env: Mapping[str, str] | None = None) -> None:
    """`ENGINE pull reference`, reporting a PullProgress each time the pull moves; PullFailed when it fails.

    The client writes to a pseudo-terminal: only there do docker and podman
    print byte counts, and without them a 10 GB layer would be minutes of
    silence that look like a stall. Cancelling the task stops the pull.
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    try:
        proc = await asyncio.create_subprocess_exec(
            *engine.client, "pull", reference,
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=dict(env) if env is not None else None, start_new_session=True,
        )
    except FileNotFoundError:
        os.close(master)
        raise EngineUnavailable(not_installed(engine)) from None
    finally:
        os.close(slave)
    state = PullState(reference)
    on_progress(state.progress())
    output: list[str] = []
    size = 0
    partial = ""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        nonlocal state, partial, size
        try:
            chunk = os.read(master, 1 << 16).decode("utf-8", "replace")
        except OSError:  # EIO: the client closed the terminal
            chunk = ""
        if not chunk:
            loop.remove_reader(master)
            if not ended.done():
                ended.set_result(None)
            return
        if size < _PULL_OUTPUT_CAP:
            output.append(chunk)
            size += len(chunk)
        text = partial + chunk
        cut = max(text.rfind("\r"), text.rfind("\n"))
        partial = text[cut + 1 :]
        for line in pull_lines(text[: cut + 1]):
            after = advance_pull(state, line)
            if after is not state:
                state = after
                on_progress(state.progress())

    loop.add_reader(master, readable)
    try:
        await ended
        status = await proc.wait()
    except asyncio.CancelledError:
        kill_group(proc.pid)
        await proc.wait()
        raise
    finally:
        loop.remove_reader(master)
        os.close(master)
    if status != 0:
        text = "".join(output) + partial
        advice = unreachable_advice(engine, text, running_user())
        if advice is not None:
            raise EngineUnavailable(f"{engine.kind} pull failed: {pull_lines(text)[-1]}; {advice}")
        raise pull_failure(engine.kind, reference, text, status)


async def prepare_image(engine: Engine, reference: str, policy: str, on_progress: ProgressHandler, env: Mapping[str, str] | None = None) -> PreparedImage:
    """The image to start, pulled as `container.pull` says; its identity, and the one the tag named before a pull."""
    before = await inspect_image(engine, reference, env)
    if policy == "never" or (policy == "missing" and before is not None):
        if before is None:
            raise not_present(engine.kind, reference)
        return PreparedImage(before, pulled=False, previous=None)
    await pull(engine, reference, on_progress, env)
    after = await inspect_image(engine, reference, env)
    if after is None:
        raise pull_failure(engine.kind, reference, f"{engine.kind} pull succeeded but the image {reference} is not present afterwards", 0)
    return PreparedImage(after, pulled=True, previous=before)
