"""What vLLM runs from, fetched before a sequence of starts: a container image, pulled with progress.

A pull of vLLM's image can take as long as loading a model (tens of GB over
a slow link), so it is watched like a start: each step the engine reports
(`Pulled`) is progress that STATUS= shows and that extends systemd's start
timeout, and none for `startup.stall_timeout_s` is a stalled pull, which is
cancelled (the lifecycle core decides, `lifecycle.begin_pull`). A pull that
cannot succeed (an unknown tag, refused credentials, an unreachable
registry) is a GiveUp with what to do: pulling again at once would fail the
same way. For vLLM from a venv there is nothing to fetch, and the pull ends
at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from ..base.command import Tunables
from ..base.config import Config
from ..base.errors import GiveUp
from ..base.image import PreparedImage, PullFailed
from ..base.levels import PRIORITY_INFO, PRIORITY_WARNING
from ..core import lifecycle
from ..core.facts import Fact, Pulled, PullEnded, Tick
from ..core.outcome import Failed
from ..launch.engine import EngineUnavailable
from ..launch.runtime import Launcher
from .reporter import Reporter


class Pull:
    """One fetch of the image: the launcher's `prepare()` as a task, its steps folded into the core's state."""

    def __init__(self, serial: int, number: int, launcher: Launcher, config: Config, reporter: Reporter, post: Callable[[Fact], None]) -> None:
        self.serial = serial
        self.config = config
        self.reporter = reporter
        self._began = time.monotonic()
        self.state = lifecycle.begin_pull(number, Tunables.from_config(config.vllm), self._began)
        self._pulling = False
        self._task = asyncio.create_task(launcher.prepare(lambda progress: post(Pulled(serial, progress))))
        self._task.add_done_callback(lambda _: post(PullEnded(serial)))

    def deadline(self) -> float | None:
        """When the pull counts as stalled unless it moves before."""
        return lifecycle.deadline(self.state, self.config)

    def handle(self, fact: Pulled | Tick) -> Failed | None:
        """A step of the pull, or its deadline passing; the stalled pull's outcome once it is cancelled."""
        if isinstance(fact, Pulled) and not self._pulling:
            self._pulling = True
            self.reporter.say("image_pull", f"pulling {fact.progress.image} (container.pull = \"{self.config.container.pull}\")", PRIORITY_INFO)
        self.state, actions = lifecycle.step(self.state, fact, time.monotonic(), self.config)
        return self._carry_out(actions)

    def _carry_out(self, actions: list[lifecycle.Action]) -> Failed | None:
        for action in actions:
            if isinstance(action, lifecycle.Finish):
                self._task.cancel()
                return action.outcome
            self.reporter.tell(action, self.state.startup)
        return None

    def result(self) -> PreparedImage | None:
        """Once the task is done: the image to start (told in the journal), or a GiveUp saying why there is none."""
        try:
            prepared = self._task.result()
        except (PullFailed, EngineUnavailable) as exc:
            raise GiveUp(str(exc), exc.exit_status) from None
        self.reporter.runs_image(prepared)
        if prepared is None:
            return None
        info = prepared.info
        if prepared.pulled:
            self.reporter.say("image_pull", f"pulled {info.reference} in {time.monotonic() - self._began:.0f} s", PRIORITY_INFO)
        self.reporter.say(
            "image",
            f"vLLM runs from the image {info.describe()}, as the container {prepared.container} ({prepared.engine})",
            PRIORITY_INFO,
            image=info.reference,
            image_digest=info.identity,
            container=prepared.container,
        )
        if prepared.moved is not None:
            self.reporter.say("image_moved", prepared.moved, PRIORITY_WARNING, image=info.reference, image_digest=info.identity)
        return prepared

    @property
    def done(self) -> bool:
        return self._task.done()

    async def close(self) -> None:
        """Stop the pull if it still runs (a stop, a reload): the engine's client ends with it."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
