"""One memory budget for every gb10d instance of a machine: who may start now, who waits, who is refused.

On GB10 each instance's `gpu_memory_utilization` is a share of the same
unified memory, and a vLLM that is still starting has not taken its share
yet: two instances that check /proc/meminfo at the same moment both see the
same free memory. So each instance keeps a `Reservation` in a ledger shared
by the machine (`ledger` is the shell that keeps it), and a start counts
what the others' starts reserved before it counts on free memory.

The rules, each a table test:
- A serving instance's memory shows in /proc/meminfo already; only the
  reservations of instances that are starting or restarting (between
  attempts, their memory given back but still theirs) are taken off
  MemAvailable. A starting instance's whole reservation counts although part
  of it may show as used by now: the error is on the safe side.
- Waiters are served in the order they asked (`asked_at` on
  CLOCK_MONOTONIC, which is the machine's, then the name): a later start
  that would fit still waits behind an earlier one.
- A restart keeps its share: between a stop of vLLM (a crash, a reload, a
  restart asked) and the next start, the instance stays restarting, its
  reservation counted by the others, and no waiter queues before it. If
  its new share does not fit yet, it waits keeping the old reservation;
  admitted, the new share is its reservation. Only a park gives it back.
- Nobody waits forever: a waiter waits only for starts and for earlier
  waiters. Once every instance it waited for serves and its share still does
  not fit, it stops waiting and the free-memory check decides (lower the
  utilization beside the others, or refuse naming them).
- `memory.when_full = "fail"` refuses at once, with the numbers, where
  "wait" would wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Annotated, Any

from pydantic import Strict, TypeAdapter, ValidationError

from ..base.units import GIB, gib
from .memory import MemInfo, Neighbours
from .tolerant import Name, Names, Number, Whole, otherwise


class Stage(str, Enum):
    """Where an instance stands in the budget; the value is what `gb10d status --all` shows."""

    WAITING = "waiting"  # asked, does not fit yet; holds a place in the queue, no memory
    STARTING = "starting"  # admitted: vLLM's first start is taking its share
    RESTARTING = "restarting"  # between attempts or in a later one: the share stays reserved
    SERVING = "serving"  # its memory shows in /proc/meminfo
    PARKED = "parked"  # on_demand.park = "stop": vLLM stopped, its memory given back; reserves nothing
    ASLEEP = "asleep"  # on_demand.park = "sleep": vLLM runs asleep, all but its CUDA context given back, until it wakes
    WAKING = "waking"  # a wake from sleep takes its share back: reserved, as a start's is, until the wake is checked

    @property
    def pending(self) -> bool:
        """Its share is reserved but /proc/meminfo does not show it as used (yet, or again)."""
        return self in (Stage.STARTING, Stage.RESTARTING, Stage.WAKING)


@dataclass(frozen=True)
class Reservation:
    """One instance's record in the ledger. Times are CLOCK_MONOTONIC seconds, the same in every process.

    `from_json` reads it by its fields' types (`core.tolerant`): what the budget needs must be there as its own type,
    or the record is none; what it can do without falls back to its default."""

    name: Name  # the systemd unit (gb10d@chat), or the config path outside systemd
    config: Name
    pid: Whole
    stage: Stage
    bytes: Whole  # utilization x MemTotal + headroom
    utilization: Number
    asked_at: Number  # when it first asked: its place in the queue, kept across its restarts
    since: Number  # when it entered this stage
    progress_at: Number  # the last sign of progress of its start (or of what it waits for)
    phase: Annotated[str, Strict(), otherwise("")] = ""
    # the MemAvailable drop measured over its own start, when no other start overlapped
    real_use: Annotated[Whole | None, otherwise(None)] = None
    waiting_for: Names = ()

    @property
    def queue_key(self) -> tuple[float, str]:
        return (self.asked_at, self.name)

    def share(self) -> str:
        """`gb10d@a (49.68 GiB, starting: loading_weights)`."""
        doing = f"{self.stage.value}: {self.phase}" if self.phase and self.phase != self.stage.value else self.stage.value
        return f"{self.name} ({gib(self.bytes)}, {doing})"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage"] = self.stage.value
        data["waiting_for"] = list(self.waiting_for)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Reservation | None:
        """A record as written by any gb10d version, or None when it lacks what the budget needs."""
        try:
            return _RECORD.validate_python(data)
        except ValidationError:
            return None


_RECORD = TypeAdapter(Reservation)


def share_bytes(utilization: float, total: int, headroom_gib: float) -> int:
    """What a start reserves: vLLM's own `ceil(total * utilization)` and the headroom kept beside it."""
    return math.ceil(total * utilization) + math.ceil(headroom_gib * GIB)


def pending(others: Sequence[Reservation]) -> list[Reservation]:
    """The instances whose reserved memory /proc/meminfo does not show yet."""
    return [o for o in others if o.stage.pending]


def left(others: Sequence[Reservation], mem: MemInfo) -> int:
    """MemAvailable less the reservations of the starts in progress: what a new start may count on."""
    return mem.available - sum(o.bytes for o in pending(others))


def neighbours(others: Sequence[Reservation]) -> Neighbours:
    """The others as the free-memory arithmetic needs them: what their starts reserved, and who they all are."""
    starts = pending(others)
    holding = sorted((o for o in others if o.stage not in (Stage.WAITING, Stage.PARKED)), key=lambda o: o.queue_key)
    return Neighbours(sum(o.bytes for o in starts), _names(starts) if starts else "", ", ".join(o.share() for o in holding))


# --- the decision --------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """Start now. `fits` False: nothing is left to wait for, yet the share does not fit; the free-memory check decides."""

    fits: bool
    others: tuple[Reservation, ...]  # every other instance, as the decision saw them
    message: str


@dataclass(frozen=True)
class Wait:
    """Not yet: `blockers` are the starts in progress and the earlier waiters this one waits for."""

    blockers: tuple[Reservation, ...]
    status: str  # STATUS=: short
    message: str  # the journal: the cause, the numbers and the action


@dataclass(frozen=True)
class Refuse:
    """`memory.when_full = "fail"`: the share does not fit beside the other starts; exit with the numbers."""

    message: str


def admit(me: Reservation, others: Sequence[Reservation], mem: MemInfo, when_full: str) -> Admit | Wait | Refuse:
    """Whether this instance's start may begin now, beside the `others` of the ledger (dead ones already left out)."""
    starts = pending(others)
    # A restart (after a crash, a reload, a restart asked) still holds the share its last start was admitted to: no
    # waiter queues before it, else one would start into the memory its vLLM just gave back.
    holds = me.stage.pending
    ahead = [] if holds else sorted((o for o in others if o.stage is Stage.WAITING and o.queue_key < me.queue_key), key=lambda o: o.queue_key)
    room = left(others, mem)
    need = _need(me, mem)
    if not ahead and me.bytes <= room:
        where = (
            f"beside the starts of {_names(starts)}: {gib(room)} of MemAvailable {gib(mem.available)} is left for it"
            if starts
            else f"in MemAvailable {gib(mem.available)}"
        )
        return Admit(True, tuple(others), f"memory: {need} fits {where}")
    # Two restarts whose shares grew do not wait for each other: one that waits itself is no start to wait for.
    blocking = [o for o in starts if not (holds and o.waiting_for)]
    blockers = tuple(sorted([*ahead, *blocking], key=lambda o: o.queue_key))
    if not blockers:
        serving = [o for o in others if o.stage is Stage.SERVING]
        beside = f" beside {_shares(serving)}" if serving else ""
        return Admit(
            False,
            tuple(others),
            f"memory: {need} does not fit in MemAvailable {gib(mem.available)}{beside}, and no other start is left "
            "to wait for; the free-memory check decides",
        )
    why = _why(me, starts, ahead, room, mem)
    if when_full == "fail":
        return Refuse(
            f"{why}; not waiting (memory.when_full = \"fail\"): start it again once they serve or stop, "
            "or lower vllm.gpu_memory_utilization"
        )
    return Wait(
        blockers,
        f"waiting for memory: needs {gib(me.bytes)}, {gib(max(room, 0))} left beside {_shares(blockers)}",
        f"{why}; waiting until they serve or stop (memory.when_full = \"wait\")",
    )


def after(me: Reservation, asked: Reservation, decision: Admit | Wait, stage: Stage, now: float) -> Reservation:
    """This instance's record after `decision` on `asked` (`me` with the share it asks for now).

    Admitted, it reserves the asked share in `stage`. Waiting, a restart keeps
    the reservation it holds, as it was, so that the others go on counting it;
    any other start waits in the queue, reserving nothing.
    """
    if isinstance(decision, Admit):
        return moved(asked, now, stage=stage, waiting_for=(), progress_at=now, phase="")
    waiting_for = tuple(b.name for b in decision.blockers)
    if me.stage.pending:
        return moved(me, now, waiting_for=waiting_for)
    return moved(asked, now, stage=Stage.WAITING, waiting_for=waiting_for)


def _need(me: Reservation, mem: MemInfo) -> str:
    headroom = me.bytes - math.ceil(mem.total * me.utilization)
    return f"gpu_memory_utilization {me.utilization:g} ({gib(me.bytes - headroom)} + {gib(headroom)} headroom)"


def _why(me: Reservation, starts: list[Reservation], ahead: list[Reservation], room: int, mem: MemInfo) -> str:
    """The cause and the numbers of a start that may not begin yet."""
    fits = me.bytes <= room
    where = f"beside the starts of {_shares(starts)}" if starts else f"in MemAvailable {gib(mem.available)}"
    numbers = f": MemAvailable {gib(mem.available)} leaves {gib(max(room, 0))}" if starts and not fits else ""
    head = f"memory: {_need(me, mem)} {'fits' if fits else 'does not fit'} {where}{numbers}"
    if not ahead:
        return head
    queue = f"{_shares(ahead)} asked first and {'waits' if len(ahead) == 1 else 'wait'}"
    return f"{head}, but {queue}" if fits else f"{head}; {queue}"


def _names(rs: Sequence[Reservation]) -> str:
    return _join([r.name for r in rs])


def _shares(rs: Sequence[Reservation]) -> str:
    return _join([r.share() for r in rs])


def _join(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# --- while waiting --------------------------------------------------------------


def progressed(seen: Mapping[str, float], blockers: Sequence[Reservation]) -> tuple[bool, dict[str, float]]:
    """Whether any instance waited for moved since `seen` (a new one counts), and what is seen now.

    A waiter extends its own start timeout only then, so a stuck start
    ahead of it does not keep it waiting beyond systemd's patience.
    """
    now = {f"{b.name}:{b.pid}": b.progress_at for b in blockers}
    moved = any(key not in seen or seen[key] < at for key, at in now.items())
    return moved, now


# --- what a start really used -----------------------------------------------------


def real_use(
    available_before: int, available_after: int, others_before: Sequence[Reservation], others_after: Sequence[Reservation]
) -> int | None:
    """The MemAvailable drop over this instance's own start, or None when it cannot be told apart from others'.

    It can be measured only when no other start was in progress at either
    end and the same other instances were there: otherwise their memory
    moved too.
    """
    if pending(others_before) or pending(others_after):
        return None
    present = {(o.name, o.pid) for o in others_before if o.stage is not Stage.WAITING}
    if present != {(o.name, o.pid) for o in others_after if o.stage is not Stage.WAITING}:
        return None
    drop = available_before - available_after
    return drop if drop >= 0 else None


def taken_since(then: Sequence[Reservation], now: Sequence[Reservation]) -> int:
    """Bytes other instances may have taken since `then`: the shares of those not yet serving then that hold memory now.

    After vLLM exits, MemAvailable is compared with its value before vLLM
    started; what other instances' starts took meanwhile is not memory this
    one failed to give back. Counted in full, so that no other start's
    memory is ever taken for a leak (a real leak is still seen when larger).
    """
    settled = {(o.name, o.pid): o.stage for o in then if o.stage in (Stage.SERVING, Stage.ASLEEP)}
    # One asleep then and awake now took its memory back meanwhile.
    return sum(
        o.bytes for o in now
        if o.stage not in (Stage.WAITING, Stage.PARKED) and settled.get((o.name, o.pid)) not in (Stage.SERVING, o.stage)
    )


def moved(me: Reservation, now: float, **changes: Any) -> Reservation:
    """`me` with `changes`; entering another stage restarts its `since`."""
    stage = changes.get("stage", me.stage)
    return replace(me, **changes, since=now if stage is not me.stage else me.since)
