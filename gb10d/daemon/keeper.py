"""The configuration in force, and everything that changes it: reloads, edits on disk, learned settings.

A start uses the snapshot taken when gb10d started or last reloaded (the
config and the env_file's contents as read then), never a file read again
behind the operator's back; only a reload reads the files anew. The keeper
also decides which settings a start begins from: the config's own, or what
a corrected start learned for this very config; and which program: a
candidate that failed before it served gives way to the last known good one
(`programs`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable

from ..base.command import Tunables
from ..base.config import Config
from ..base.configload import load_config
from ..base.errors import ConfigError
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..core import learned, programs
from ..core.reload import ConfigDiff, ConfigSnapshot, OnlyReported, ReloadRefused, judge_reload
from ..machine import programsfile
from .learnedfile import LearnedFileError, load, load_start_times, save, save_start_times, start_times_file
from .reporter import Reporter
from .watcher import ConfigWatcher, WatchUnavailable


class ConfigKeeper:
    """Holds the snapshot vLLM starts from; reloads it, watches its files and keeps what was learned."""

    def __init__(self, path: Path, snapshot: ConfigSnapshot, reporter: Reporter) -> None:
        self.path = path
        self.snapshot = snapshot
        self.reporter = reporter
        # Why the settings now in use differ from the config's, for the learned-settings file.
        # The identity of the container image the current sequence of starts runs (None: not a container).
        self.image: str | None = None
        self._watcher: ConfigWatcher | None = None
        # The snapshot that last served in this run: what a failed candidate gives way to.
        self.served_snapshot: ConfigSnapshot | None = None

    @property
    def config(self) -> Config:
        return self.snapshot.config

    def env(self, tunables: Tunables | None = None) -> dict[str, str]:
        """vLLM's environment from the snapshot (the env_file as last read), with what `tunables` add."""
        return self.snapshot.env(added=tunables.env if tunables else ())

    # --- watching and reloading ----------------------------------------------

    def watch(self, loop: asyncio.AbstractEventLoop, on_edit: Callable[[], None]) -> None:
        """Report edits of the config and its drop-ins through `on_edit`, if `daemon.watch_config`."""
        if not self.config.daemon.watch_config:
            return
        watcher = ConfigWatcher(self.path, loop, on_edit)
        try:
            watcher.start()
        except WatchUnavailable as exc:
            self.reporter.say("config_changed_on_disk", f"not watching the config for changes: {exc}", PRIORITY_WARNING)
            return
        self._watcher = watcher

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def take(self, requested: bool) -> ConfigDiff | None:
        """Re-read and validate the config; apply it if asked to; the changes applied, or None.

        An invalid file is logged problem by problem and changes nothing. An
        edit seen on disk is only reported unless `daemon.apply_on_change`.
        """
        say = self.reporter.say
        if requested:
            say("reload_requested", f"reload requested: re-reading {self.path}", PRIORITY_INFO)
        try:
            new = ConfigSnapshot.take(load_config(self.path))
        except ConfigError as exc:
            for problem in exc.problems:
                say("reload_invalid", f"config not applied: {problem}", PRIORITY_ERR)
            say(
                "reload_invalid",
                "keeping the running configuration; fix the file, check it with gb10d check-config, then: systemctl reload gb10d",
                PRIORITY_ERR,
            )
            return None
        diff = judge_reload(str(self.path), self.snapshot, new, programsfile.load(self.programs_file), requested)
        if isinstance(diff, ReloadRefused):
            for line in diff.lines:
                say("reload_invalid", line, PRIORITY_ERR)
            return None
        if isinstance(diff, OnlyReported):
            say("config_changed_on_disk", diff.line, PRIORITY_INFO)
            return None
        if not diff:
            say("reload_applied", "config re-read: nothing changed", PRIORITY_INFO)
            return diff
        self.snapshot = new
        self.reporter.reconfigured(new.config)
        return diff

    # --- the program: good, candidate, rejected ---------------------------------

    @property
    def programs_file(self) -> Path:
        return programs.programs_file(self.config.daemon.learned_file)

    def is_candidate(self) -> bool:
        """Whether this start runs another program than the last known good one."""
        return programs.is_candidate(self.config, programsfile.load(self.programs_file))

    def avoid_rejected(self) -> None:
        """At gb10d's start: a config that runs the rejected candidate starts the good program instead."""
        record = programsfile.load(self.programs_file)
        if record.good is None or record.rejected is None or not programs.is_rejected(self.config, record):
            return
        self.snapshot = replace(self.snapshot, config=programs.fall_back(self.config, record.good))
        self.reporter.say(
            "program_rolled_back",
            f"the config runs the candidate {record.rejected.program.describe()}, which failed its start {record.rejected.at} "
            f"({record.rejected.failure}); starting the last good {record.good.describe()} instead; once the candidate is "
            "fixed: gb10d forget --candidate, then systemctl restart gb10d",
            PRIORITY_WARNING,
        )

    def roll_back(self, failure: str, version: str | None) -> tuple[programs.Program, programs.Program]:
        """The candidate failed before it served: keep why, and go back to the good program (the candidate, the good one).

        The settings that served under the good program in this run come back
        with it; after a restart of gb10d only the program changes.
        """
        record = programsfile.load(self.programs_file)
        assert record.good is not None
        candidate = programsfile.identify(self.config.vllm, version)
        self._save(programs.reject(record, candidate, failure, _now()))
        back = self.served_snapshot
        if back is not None and programs.program_path(back.config.vllm) == record.good.path:
            self.snapshot = back
        else:
            self.snapshot = replace(self.snapshot, config=programs.fall_back(self.config, record.good))
        self.reporter.reconfigured(self.config)
        return candidate, record.good

    def _save(self, record: programs.Programs) -> None:
        try:
            programsfile.save(self.programs_file, record)
        except OSError as exc:
            self.reporter.say("learned_discarded", f"cannot keep the record of vLLM programs in {self.programs_file}: {exc}", PRIORITY_WARNING)

    def served(self, tunables: Tunables, version: str | None) -> None:
        """The start reached ready: keep what was learned, and its program as the good one (a candidate is accepted)."""
        self.remember(tunables)
        self.keep_start_times()
        self.served_snapshot = self.snapshot
        record = programsfile.load(self.programs_file)
        now = programsfile.identify(self.config.vllm, version)
        if record.good != now:
            self._save(programs.served(record, now, _now()))
        if record.good is not None and record.good.path != now.path:
            self.reporter.say(
                "program_accepted",
                f"the candidate {now.describe()} served: it is the good program from now on (before: {record.good.describe()})",
                PRIORITY_INFO,
            )

    # --- learned settings -------------------------------------------------------

    def starting_tunables(self, image: str | None = None) -> Tunables:
        """The config's settings, or what a corrected start learned for this very config (and container `image`)."""
        base = Tunables.from_config(self.config.vllm)
        self.image = image
        self.reporter.start_times(load_start_times(start_times_file(self.config.daemon.learned_file), learned.fingerprint(self.config, image)))
        state = load(self.config.daemon.learned_file)
        if state.problem:
            self.reporter.say("learned_discarded", f"{state.problem}; starting from the config's values", PRIORITY_WARNING)
        verdict = learned.applicable(state, self.config, image)
        if verdict.entry is not None:
            self.reporter.say("learned_applied", verdict.reason, PRIORITY_INFO, gpu_memory_utilization=verdict.entry.gpu_memory_utilization)
            return learned.merge(base, verdict.entry).with_(why=verdict.entry.reason)
        if verdict.reason:
            self.reporter.say("learned_discarded", verdict.reason, PRIORITY_INFO)
        return base

    def keep_start_times(self) -> None:
        """The start reached ready: its phases' times are the next start's estimate (`gb10d status`, STATUS=, the page)."""
        phases = self.reporter.phase_seconds()
        try:
            save_start_times(start_times_file(self.config.daemon.learned_file), learned.fingerprint(self.config, self.image), phases, _now())
        except LearnedFileError as exc:
            self.reporter.say("learned_discarded", f"cannot keep the start's phase times for the next estimate: {exc}", PRIORITY_WARNING)
            return
        self.reporter.start_times(phases)

    def remember(self, tunables: Tunables) -> None:
        """After a corrected start reached ready, keep what worked for the next boot."""
        entry = learned.remember(self.config, tunables, tunables.why or "a corrected start", datetime.now(UTC), self.image)
        if entry is None:
            return
        try:
            save(self.config.daemon.learned_file, learned.LearnedState(entry))
        except LearnedFileError as exc:
            self.reporter.say("learned_discarded", f"cannot keep the learned settings: {exc}", PRIORITY_WARNING)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
