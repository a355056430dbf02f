"""Models on demand, the front's part: park an idle on-demand instance, wake a parked one that requests wait for,
and park the least recently used idle one first when the wanted one does not fit. Every decision is
gb10d.front.core's (should_park, should_wake, make_room); this module reads the memory it needs and asks each
instance's gb10d over its control socket, never over vLLM's public port.
"""

from __future__ import annotations

import asyncio
import time

from ..core import budget
from ..daemon.control import ask
from ..machine.ledger import read_ledger
from ..machine.memory import read_meminfo
from .core import Evict, Room, Slot, StartIt, make_room, should_park, should_wake
from .journal import FrontJournal
from .metrics import FrontMetrics
from .states import States, Watched

# After an instance's gb10d did not take a park or wake (not running, an old gb10d), ask again this much later.
ASK_AGAIN_S = 5.0
# A park or wake that the state file never shows (its gb10d took it and then died, say) is forgotten after this:
# the flags never stick.
ASKED_EXPIRE_S = 120.0


class Swaps:
    def __init__(self, states: States, journal: FrontJournal, metrics: FrontMetrics) -> None:
        self.states = states
        self.journal = journal
        self.metrics = metrics
        self.asking: set[asyncio.Future[None]] = set()

    def tick(self, watched: Watched) -> None:
        """Wake a parked instance that a request waits for; park an on-demand one idle for its timeout."""
        known = watched.known
        if known.control is None:
            return
        now = time.monotonic()
        if watched.ready.serving and watched.wake_asked_at is not None:
            self.metrics.swap_seconds.labels(watched.name).observe(now - watched.wake_asked_at)
            watched.wake_asked_at = None
        if watched.draining and watched.in_flight == 0:
            watched.draining = False
            self.ask(watched, "park")
        if ((watched.parking_asked and not watched.draining) or watched.wake_asked) and now - watched.asked_at > ASKED_EXPIRE_S:
            self.journal.say(f"{watched.name}'s state file never showed the {'park' if watched.parking_asked else 'wake'} asked {ASKED_EXPIRE_S:.0f} s ago; asking anew when needed", 4)
            watched.parking_asked = watched.wake_asked = False
            self.states.notify(watched, left=False)
        if should_wake(watched.ready, watched.held, watched.in_flight, watched.wake_asked):
            self.make_room(watched)
        idle_s = now - watched.active_at
        if should_park(watched.ready, watched.held, watched.in_flight, idle_s, known.idle_timeout_s, watched.parking_asked):
            self.journal.say(f"parking {watched.name}: no request for {idle_s:.0f} s (on_demand.idle_timeout_s)")
            self.metrics.swaps.labels(watched.name, "park").inc()
            self.ask(watched, "park")

    def make_room(self, watched: Watched) -> None:
        """Wake a parked instance that requests wait for when it fits; else park the least recently used idle
        on-demand one for it (its memory comes back before the wake), or keep holding; each decision said once."""
        name = watched.name
        decided = self.room(watched)
        if isinstance(decided, StartIt):
            watched.wake_asked_at, watched.room_said = time.monotonic(), ""
            self.journal.say(f"waking {name}: {watched.held + watched.in_flight} request(s) wait for it; {decided.message}")
            self.metrics.swaps.labels(name, "wake").inc()
            self.ask(watched, "wake")
        elif isinstance(decided, Evict):
            victim = self.states[decided.victim]
            self.journal.say(f"{'draining' if decided.drain else 'evicting'} {decided.victim} to make room for {name}: {decided.message}")
            self.metrics.swaps.labels(decided.victim, "evict").inc()
            if decided.drain:
                # Its new requests wait from now on (as for a park); the park is asked by tick once none is in flight.
                victim.draining = victim.parking_asked = True
                victim.asked_at = time.monotonic()
                self.states.notify(victim, left=False)
            else:
                self.ask(victim, "park")
        else:
            text = decided.message  # AwaitRoom, or an Answer: it can no longer fit (a pinned instance started meanwhile)
            if text != watched.room_said:
                watched.room_said = text
                self.journal.say(f"holding requests for {name}: {text}")

    def room(self, watched: Watched) -> Room:
        """make_room on MemAvailable and the memory ledger as they are now, with every instance as the front sees it."""
        memory = watched.known.memory
        try:
            mem = read_meminfo(memory.meminfo_path)
        except (OSError, ValueError) as exc:
            return StartIt(f"{memory.meminfo_path} cannot be read ({exc}); the instance's own memory checks decide")
        try:
            records = read_ledger(memory.ledger_path) if memory.ledger_path is not None else []
        except OSError:
            records = []  # no ledger: every instance runs alone as far as the budget knows
        booked = {r.pid for r in records if r.stage.pending}
        # Every instance read now, not up to a poll ago: a gb10d killed with its vLLM gives its memory back at once,
        # and counted as serving from the last poll, that memory would look free for the start decided now.
        for other in self.states.watched.values():
            if other is not watched:
                self.states.refresh(other)
        slots = {n: self._slot(w, mem.total, booked) for n, w in self.states.watched.items()}
        wanted = slots.pop(watched.name)
        return make_room(wanted, list(slots.values()), budget.left(records, mem), mem.total)

    def first_room(self, watched: Watched) -> Room | None:
        """The room for the first request that finds its model parked (not for each of a flood): a model that can
        never fit is refused at once, not held."""
        if watched.ready.parked and not watched.wake_asked and watched.held == 0:
            return self.room(watched)
        return None

    @staticmethod
    def _slot(watched: Watched, total: int, booked: set[int]) -> Slot:
        """The instance as make_room counts it; `booked`: the gb10d pids whose share the ledger reserves now."""
        known, ready, now = watched.known, watched.ready, time.monotonic()
        # Asked to wake, or starting (not serving, parked or parking) while its record reserves nothing yet: a wake
        # asked and not yet taken, a start before its admission, a wake from sleep without a ledger.
        coming = (watched.wake_asked and ready.parked) or (ready.coming and not (ready.serving or ready.parked or ready.parking))
        return Slot(
            known.instance.name, budget.share_bytes(known.utilization, total, known.memory.headroom_gib), known.control is not None,
            running=ready.coming and not ready.parked, serving=ready.serving, parking=watched.parking_asked or ready.parking,
            busy=watched.held + watched.in_flight > 0, unbooked=coming and watched.pid not in booked, active_at=watched.active_at,
            asleep=ready.asleep, waited_s=now - watched.hold_started if watched.held else 0.0,
            served_s=now - watched.serving_since if ready.serving else 0.0,
        )

    def ask(self, watched: Watched, command: str) -> None:
        """Ask the instance's gb10d over its control socket, without holding up the state poll; when it does not
        take the command, a poll ASK_AGAIN_S later may ask again (not every poll: one warning, not ten a second).
        A park holds the model's new requests from now on, until it has parked (they then wake it)."""
        path, name = watched.known.control, watched.name
        assert path is not None
        watched.asked_at = time.monotonic()
        if command == "park":
            watched.parking_asked = True
        else:
            watched.wake_asked = True

        async def send() -> None:
            answer = await ask(path, command)
            if answer != "ok":
                self.journal.say(f"{name}'s gb10d did not take {command!r} on {path}: {answer or 'no answer'}", 4, cause=f"ask {name}")
                asyncio.get_running_loop().call_later(ASK_AGAIN_S, again)

        def again() -> None:
            watched.wake_asked = watched.parking_asked = False
            self.states.notify(watched, left=False)

        task = asyncio.ensure_future(send())
        self.asking.add(task)
        task.add_done_callback(self.asking.discard)

