"""The memory ledger on disk: one record file per gb10d instance, in a directory every instance of the machine shares.

Crash safety comes from the kernel. Each instance holds an flock on its own
record for its whole life, and the kernel lets go of it however the process
ends (`kill -9`, a crash): a record whose lock is free belongs to nobody, is
left out, and is removed by the next instance that decides. The directory
lives in /run, a tmpfs, so a reboot clears it. One more file, `.lock`, is
held while an admission is decided and while a record changes, so two
instances never decide on the same memory at once and a reader never sees
half a record. Records are small JSON objects (`budget.Reservation`),
rewritten in place: their lock lives on the file, so the file must stay.

What the records mean and what may start is `budget`'s to decide; this
module only keeps them.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

from ..base.errors import EXIT_CONFIG, GiveUp, LedgerUnavailable
from ..base.instance import Clash, clashes, instance_of
from ..core import budget
from ..core.budget import Admit, Refuse, Reservation, Stage, Wait
from ..core.memory import MemInfo
from .service import LEDGER_GROUP as GROUP
from .service import unit_name

LOCK_NAME = ".lock"
SUFFIX = ".json"
# Readable by operators who are not in the gb10d group, as the state file is: `gb10d status --all` shows it.
# A record is written by its own instance only; the lock by every instance, whichever user its unit runs as.
FILE_MODE = 0o644
LOCK_MODE = 0o664
# As the package's tmpfiles.d line makes it (group gb10d, inherited by what is created in it).
DIR_MODE = 0o2775

ErrorHandler = Callable[[str], None]
NOTHING: Mapping[str, str] = MappingProxyType({})  # an instance that says nothing of what it holds


def record_path(directory: Path, name: str) -> Path:
    """The record of instance `name`: a unit name as it is, a config path with its slashes escaped."""
    return directory / (quote(name, safe="@._-") + SUFFIX)


@contextmanager
def locked(directory: Path, exclusive: bool) -> Iterator[bool]:
    """Hold the ledger's `.lock`; yields False when there is none yet (nobody ever wrote a record).

    Writers create it; readers need only read access, so `gb10d status --all`
    works for anyone who may read the directory.
    """
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, LOCK_MODE) if exclusive else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if exclusive:
            raise
        yield False
        return
    try:
        if exclusive:
            _share(fd, LOCK_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _share(fd: int, mode: int) -> None:
    """`mode` whatever the creator's umask (UMask=0027 under systemd); only the creator may change it."""
    try:
        os.fchmod(fd, mode)
    except PermissionError:
        pass


def _alive(fd: int) -> bool:
    """Whether a living process holds the record's lock (a probe that gets it lets go at once)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _json(fd: int) -> Any:
    data = b""
    while chunk := os.pread(fd, 65536, len(data)):
        data += chunk
    try:
        return json.loads(data)
    except ValueError:
        return None  # empty: its instance has not written it yet


def _read(fd: int) -> Reservation | None:
    """The record, or None before its instance decided anything (it may have said only what it holds)."""
    return Reservation.from_json(_json(fd))


def scan(directory: Path, skip: Path | None = None, remove_dead: bool = False) -> list[Reservation]:
    """The records of living instances (the caller holds `.lock`); dead ones are removed when `remove_dead`."""
    found: list[Reservation] = []
    for path in sorted(directory.glob("*" + SUFFIX)):
        if path == skip:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if not _alive(fd):
                if remove_dead:
                    path.unlink(missing_ok=True)
                continue
            record = _read(fd)
        finally:
            os.close(fd)
        if record is not None:
            found.append(record)
    return found


def _holders(directory: Path, skip: Path | None) -> list[tuple[str, str, int, dict[str, str]]]:
    """(name, config, pid, what it holds) of each living instance that said what it holds; the caller holds `.lock`."""
    found = []
    for path in sorted(directory.glob("*" + SUFFIX)):
        if path == skip:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = _json(fd) if _alive(fd) else None
        finally:
            os.close(fd)
        held = data.get("holds") if isinstance(data, dict) else None
        if isinstance(data, dict) and isinstance(held, dict) and isinstance(data.get("pid"), int):
            found.append((str(data.get("name")), str(data.get("config")), int(data["pid"]), {str(k): str(v) for k, v in held.items()}))
    return found


def held_elsewhere(directory: Path, config: str, mine: Mapping[str, str]) -> list[Clash]:
    """What of `mine` living instances of other configs hold, for `gb10d check-config`; [] without a readable ledger."""
    try:
        with locked(directory, exclusive=False) as exists:
            others = _holders(directory, None) if exists else []
    except OSError:
        return []
    return clashes(mine, [other for other in others if os.path.realpath(other[1]) != os.path.realpath(config)])


def read_ledger(directory: Path) -> list[Reservation]:
    """Every living instance's record, for `gb10d status --all`; raises OSError when the directory cannot be read."""
    if not directory.exists():
        raise FileNotFoundError(2, "No such directory", str(directory))
    if not directory.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(directory))
    with locked(directory, exclusive=False) as exists:
        return scan(directory) if exists else []


def _take_over(path: Path, name: str, directory: Path) -> None:
    """Remove a dead predecessor's record of this name (perhaps another user's: the unit's user changed); refuse
    when a living gb10d holds it. The caller holds `.lock`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if _alive(fd):
            other = _read(fd)
            pid = f" (pid {other.pid})" if other is not None else ""
            raise GiveUp(
                f"another gb10d{pid} already runs as {name} (its record in the memory ledger {directory} is held); "
                "two supervisors of one config would fight over its port and memory: stop the other one first",
                EXIT_CONFIG,
            )
    finally:
        os.close(fd)
    path.unlink()


class Booking:
    """This instance's record in the ledger, held (locked) from `open` to `close`."""

    def __init__(self, directory: Path, name: str, config: str, fd: int, on_error: ErrorHandler, holds: Mapping[str, str] = NOTHING) -> None:
        self.directory = directory
        self.name = name
        self.config = config
        self.holds = dict(holds)
        self.path = record_path(directory, name)
        self._fd = fd
        self._on_error = on_error
        self._failed = False
        self.record: Reservation | None = None  # None until the first decision
        self.admitted_beside: tuple[Reservation, ...] = ()  # the others when this start was admitted

    @classmethod
    def open(cls, directory: Path, name: str, config: str, on_error: ErrorHandler, holds: Mapping[str, str] = NOTHING) -> Booking:
        """Take this instance's record and say in it what the instance `holds`; LedgerUnavailable when the directory
        cannot be used, GiveUp when another living gb10d holds the name or any of `holds`."""
        if not directory.is_dir():
            raise LedgerUnavailable(f"{directory} does not exist")
        path = record_path(directory, name)
        try:
            with locked(directory, exclusive=True):
                _take_over(path, name, directory)
                taken = clashes(holds, _holders(directory, path))
                if taken:
                    me = name if name == config else f"{name} ({config})"
                    own = instance_of(Path(config)) is not None
                    raise GiveUp("; ".join(f"{clash.key} {clash.describe(me, own)}" for clash in taken), EXIT_CONFIG)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
                fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can hold it: the file is new, under `.lock`
                _share(fd, FILE_MODE)
                booking = cls(directory, name, config, fd, on_error, holds)
                booking._put({"name": name, "config": config, "pid": os.getpid()})
        except OSError as exc:
            raise LedgerUnavailable(f"{directory}: {exc.strerror or exc}") from None
        return booking

    # --- what the supervisor asks -------------------------------------------------

    def decide(self, utilization: float, share: int, stage: Stage, mem: MemInfo, when_full: str) -> Admit | Wait | Refuse:
        """Ask for `share` bytes; on Admit the record says `stage` from now on, on Wait it says waiting.

        One decision at a time on the whole machine: the admission and the
        record that tells the others happen under `.lock`.
        """
        self.keep()
        now = time.monotonic()
        try:
            with locked(self.directory, exclusive=True):
                others = scan(self.directory, skip=self.path, remove_dead=True)
                asked = self._me(now, utilization=utilization, bytes=share)
                decision = budget.admit(asked, others, mem, when_full)
                if isinstance(decision, Admit):
                    self.admitted_beside = tuple(others)
                if not isinstance(decision, Refuse):
                    self._write(budget.after(self.record or asked, asked, decision, stage, now))
                return decision
        except OSError as exc:
            self._report(exc)
            return Admit(True, (), "memory: the ledger cannot be used; starting without counting other instances' starts")

    def wake(self, refusal_of: Callable[[list[Reservation]], str | None]) -> str | None:
        """A wake from sleep, decided and told as a start's admission is, under `.lock`: `refusal_of` judges it
        beside the others' records, and a wake it allows reserves the share at once (stage waking). Decided apart
        from the record, a wake and another's start could each count the memory the other was about to take.
        Returns the refusal, or None (also when the ledger cannot be used: the caller's own check stands)."""
        self.keep()
        now = time.monotonic()
        try:
            with locked(self.directory, exclusive=True):
                refusal = refusal_of(scan(self.directory, skip=self.path, remove_dead=True))
                if refusal is None and self.record is not None:
                    self._write(budget.moved(self.record, now, stage=Stage.WAKING, progress_at=now))
                return refusal
        except OSError as exc:
            self._report(exc)
            return None

    def keep(self) -> None:
        """Write this instance's record again when it was removed (the ledger directory with it: an rm -r, a cleanup
        of /run), so that the other instances count its share again; the directory is made again if need be.

        A record is rewritten in place through the descriptor its lock is on, so a removed one would otherwise stay
        gone, its writes landing in a file nobody can see, until this gb10d restarts."""
        try:
            if os.fstat(self._fd).st_nlink > 0:
                return
            self.directory.mkdir(mode=DIR_MODE, exist_ok=True)
            with locked(self.directory, exclusive=True):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
                fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can hold it: the file is new, under `.lock`
                _share(fd, FILE_MODE)
                os.close(self._fd)
                self._fd = fd
                self._put(self.record.to_json() if self.record is not None else {"name": self.name, "config": self.config, "pid": os.getpid()})
        except OSError as exc:
            self._report(exc)
            return
        self._failed = False  # a later failure is news again
        self._on_error(f"memory ledger {self.directory}: this instance's record had been removed; written again, the other gb10d instances count its share again")

    def others(self) -> list[Reservation]:
        """The other living instances now."""
        self.keep()
        try:
            with locked(self.directory, exclusive=True):
                return scan(self.directory, skip=self.path, remove_dead=True)
        except OSError as exc:
            self._report(exc)
            return []

    def update(self, **changes: Any) -> None:
        """Change this instance's record (stage, phase, progress_at, ...); nothing before the first decision."""
        if self.record is None:
            return
        self.keep()
        try:
            with locked(self.directory, exclusive=True):
                self._write(budget.moved(self.record, time.monotonic(), **changes))
        except OSError as exc:
            self._report(exc)

    def progressed(self) -> None:
        """A sign of progress: instances that wait for this one extend their start timeouts."""
        self.update(progress_at=time.monotonic())

    def serving(self, available_before: int | None, available_now: int | None) -> None:
        """vLLM serves: its memory shows in /proc/meminfo now; what it used is kept when it can be told."""
        if self.record is None:
            return
        self.keep()
        try:
            with locked(self.directory, exclusive=True):
                others = scan(self.directory, skip=self.path, remove_dead=True)
                used = (
                    budget.real_use(available_before, available_now, self.admitted_beside, others)
                    if available_before is not None and available_now is not None
                    else None
                )
                self._write(budget.moved(self.record, time.monotonic(), stage=Stage.SERVING, phase="ready", real_use=used))
        except OSError as exc:
            self._report(exc)

    def parked(self, utilization: float, share: int) -> None:
        """vLLM is stopped until the front asks for it: the record reserves nothing, and says what a start would need."""
        self.keep()
        now = time.monotonic()
        try:
            with locked(self.directory, exclusive=True):
                me = self._me(now, utilization=utilization, bytes=share)
                self._write(budget.moved(me, now, stage=Stage.PARKED, waiting_for=(), phase="", real_use=None))
        except OSError as exc:
            self._report(exc)

    def close(self) -> None:
        """Remove the record and let go of it: this instance reserves nothing any more."""
        try:
            with locked(self.directory, exclusive=True):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the lock goes with the descriptor anyway: a record left behind is a dead one
        finally:
            os.close(self._fd)

    # --- inside -------------------------------------------------------------------

    def _me(self, now: float, utilization: float, bytes: int) -> Reservation:
        if self.record is None:
            return Reservation(
                name=self.name, config=self.config, pid=os.getpid(), stage=Stage.WAITING, bytes=bytes,
                utilization=utilization, asked_at=now, since=now, progress_at=now,
            )
        return budget.moved(self.record, now, utilization=utilization, bytes=bytes)

    def _write(self, record: Reservation) -> None:
        """Rewrite the record in place (its lock is on this file); the caller holds `.lock`."""
        self._put(record.to_json())
        self.record = record

    def _put(self, fields: dict[str, Any]) -> None:
        """Rewrite the file in place with `fields` and what this instance holds; the caller holds `.lock`."""
        data = json.dumps({**fields, "holds": self.holds}, sort_keys=True).encode() + b"\n"
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))

    def _report(self, exc: OSError) -> None:
        if not self._failed:
            self._failed = True
            self._on_error(f"memory ledger {self.directory}: {exc.strerror or exc}; other gb10d instances may not see this one's share")


def open_booking(
    directory: Path | None, name: str, config: str, on_error: ErrorHandler, holds: Mapping[str, str] = NOTHING
) -> Booking | None:
    """This instance's booking, or None (after one warning through `on_error`) when the ledger cannot be used."""
    if directory is None:
        return None
    try:
        return Booking.open(directory, name, config, on_error, holds)
    except LedgerUnavailable as exc:
        on_error(
            f"memory ledger {exc}: this instance starts without counting the starts of other gb10d instances on this "
            f"machine (they may race for the same memory). The package creates it (systemd-tmpfiles --create gb10d.conf); "
            f"a service not run as {GROUP} needs SupplementaryGroups={GROUP}; set memory.ledger_dir = \"\" to run alone"
        )
        return None


def instance_name(config: Path, environ: Mapping[str, str] = os.environ, cgroup: Path = Path("/proc/self/cgroup")) -> str:
    """The unit (`gb10d@chat`) when gb10d is that unit's main process, else the config file: unique on a machine.

    systemd sets SYSTEMD_EXEC_PID for the process it starts; a gb10d run by
    hand from a shell inside some other unit inherits a pid that is not its own.
    """
    if environ.get("SYSTEMD_EXEC_PID") == str(os.getpid()):
        unit = unit_name(cgroup, default="")
        if unit:
            return unit
    return str(config)
