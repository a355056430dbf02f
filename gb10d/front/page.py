"""The front's page (/ui/): its static files, its data as JSON and as a Server-Sent Events stream, and the wake, park
and restart buttons, which ask the instance's gb10d over its control socket (wake and park as the front's own swaps
do).

Everything shown is decided by gb10d.front.pagemodel; this module reads the files (state files, /proc/meminfo, the
memory ledger), vLLM's /metrics (every METRICS_EVERY_S, only while a page is open) and answers. The page's data
follows the key rules of /v1/models: with front.api_keys, a valid key is needed and a restricted key sees its own
models only. No cookies: the page keeps the key in sessionStorage and sends it as `Authorization`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import resources
from typing import Any

import aiohttp
from aiohttp import web

from ..core import budget
from ..core.memory import MemInfo
from ..core.statefile import StateRecord
from ..daemon.control import ask
from ..daemon.probe import OWN_PARAMS, base_url
from ..machine.ledger import read_ledger
from ..machine.memory import read_meminfo
from ..machine.statefile import read_state
from ..vllm.sleepmode import control_path
from . import pagemodel
from .core import Answer, error
from .journal import FrontJournal
from .routes import ApiKey, authorized, bare
from .states import States, Watched
from .swaps import Swaps

# The page's files, shipped in the package (gb10d/front/ui/), and their types.
FILES = {"index.html": "text/html; charset=utf-8", "page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}
# The page's own files change with the package only: a browser may keep them this long.
FILES_MAX_AGE_S = 60


class Page:
    """The page's routes. `keys` gives the front's keys now (a reload may change them)."""

    def __init__(self, states: States, swaps: Swaps, journal: FrontJournal, keys: Callable[[], Sequence[ApiKey]]) -> None:
        self.states = states
        self.swaps = swaps
        self.journal = journal
        self.keys = keys
        # Set when the front stops: the page's streams end, so that they do not hold up the drain.
        self.stopping = asyncio.Event()
        self.files = {name: (resources.files(__package__) / "ui" / name).read_bytes() for name in FILES}
        self.streams = 0
        self.samples: dict[str, tuple[pagemodel.Sample | None, pagemodel.Sample | None]] = {}
        self.scraper: asyncio.Task[None] | None = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse | None:
        """The page's answer, or None for a request that is not the page's (the proxy goes on with it)."""
        path, method = bare(request.raw_path), request.method
        if path == "/" and method in ("GET", "HEAD") and "text/html" in request.headers.get("Accept", ""):
            return web.Response(status=302, headers={"location": "/ui/"})
        if path == "/ui":
            return web.Response(status=302, headers={"location": "/ui/"})
        if not path.startswith("/ui/"):
            return None
        name = path[len("/ui/"):] or "index.html"
        if name in FILES:
            if method not in ("GET", "HEAD"):
                return self._json(error(405, f"{path} answers GET", "MethodNotAllowedError"))
            return web.Response(body=self.files[name], headers={"content-type": FILES[name], "cache-control": f"max-age={FILES_MAX_AGE_S}"})
        keys = self.keys()
        key = authorized(path, request.raw_headers, keys)
        if isinstance(key, Answer):
            return self._json(key)
        allowed = key.models if key is not None else frozenset()
        if name == "data" and method == "GET":
            return web.json_response(self.data(allowed, _origin(request)))
        if name == "events" and method == "GET":
            return await self._events(request, allowed)
        if name.startswith("actions/") and method == "POST":
            return await self._act(request, name.split("/")[1:], key, bool(keys))
        return self._json(error(404, f"{path} is not one of the page's routes (/ui/, /ui/data, /ui/events, POST /ui/actions/INSTANCE/wake|park|restart)", "NotFoundError"))

    @staticmethod
    def _json(answer: Answer) -> web.Response:
        return web.json_response(dict(answer.body), status=answer.status)

    # --- the data -------------------------------------------------------------------------------------------------

    def data(self, allowed: frozenset[str], origin: str) -> dict[str, Any]:
        """Everything the page shows, as one JSON object: the memory bar, the cards, the recent decisions; `origin`:
        the front's address as the page's browser reached it, for the curl commands."""
        now = time.time()
        watched = list(self.states.watched.values())
        records = {w.name: self._state(w) for w in watched}
        cards = pagemodel.visible((self._card(w, records[w.name], now, origin, bool(self.keys())) for w in watched), allowed)
        shown = {c.instance for c in cards}
        # The front's lines and the machine's memory name every model: only for a key that may see them all.
        everything = not allowed or len(shown) == len(watched)
        said = [(at, level, "front", line) for at, level, line in self.journal.recent] if everything else []
        for w in watched:
            record = records[w.name]
            if w.name in shown and record is not None:
                said += [(d.at, d.priority, w.name, d.message) for d in record.decisions]
        said.sort()
        decisions = [{"at": at, "level": level, "who": who, "line": line} for at, level, who, line in said]
        return {
            "memory": self._memory(watched, records) if everything else None,
            "cards": [asdict(c) for c in cards],
            "decisions": decisions[-pagemodel.DECISIONS:],
            "keyed": bool(self.keys()),
        }

    def _state(self, watched: Watched) -> StateRecord | None:
        with contextlib.suppress(OSError):
            return read_state(watched.known.state_file)
        return None

    def _card(self, watched: Watched, state: StateRecord | None, now: float, origin: str, keyed: bool) -> pagemodel.Card:
        known = watched.known
        before, after = self.samples.get(watched.name, (None, None))
        return pagemodel.card(
            watched.name, known.instance.models, state, self.states.current(watched), watched.held, watched.in_flight,
            known.control is not None, pagemodel.rates(before, after), origin, keyed, now,
        )

    def _memory(self, watched: Sequence[Watched], records: dict[str, StateRecord | None]) -> dict[str, Any] | None:
        """The memory bar, from the first instance's meminfo and ledger (one machine: every instance reads the same)."""
        if not watched:
            return None
        memory = watched[0].known.memory
        try:
            mem = read_meminfo(memory.meminfo_path)
        except (OSError, ValueError):
            return None
        try:
            ledger = read_ledger(memory.ledger_path) if memory.ledger_path is not None else []
        except OSError:
            ledger = []
        holders = [self._holder(w, records[w.name], ledger, mem) for w in watched]
        bar = pagemodel.memory_bar(mem, holders, memory.headroom_gib)
        out = asdict(bar)
        out["shortfalls"] = [asdict(s) for s in pagemodel.shortfalls(mem, holders, budget.left(ledger, mem))]
        return out

    @staticmethod
    def _holder(watched: Watched, state: StateRecord | None, ledger: Sequence[budget.Reservation], mem: MemInfo) -> pagemodel.Holder:
        known = watched.known
        named = state.instance if state is not None else None
        record = next((r for r in ledger if named is not None and r.name == named), None)
        share = budget.share_bytes(known.utilization, mem.total, known.memory.headroom_gib)
        return pagemodel.Holder(watched.name, record, state, share, known.utilization)

    # --- the event stream -------------------------------------------------------------------------------------------

    async def _events(self, request: web.BaseRequest, allowed: frozenset[str]) -> web.StreamResponse:
        """The page's data whenever it changed, at most every SEND_EVERY_S, and a comment after COMMENT_EVERY_S of
        silence; vLLM's /metrics is read while at least one stream is open."""
        # x-accel-buffering: nginx before the front (for TLS) passes each event as it comes instead of buffering them.
        headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache", "x-accel-buffering": "no"}
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        pace = pagemodel.Pace()
        origin = _origin(request)
        self.streams += 1
        if self.scraper is None:
            self.scraper = asyncio.ensure_future(self._scrape())
        try:
            while not self.stopping.is_set():
                event = pace.next(json.dumps(self.data(allowed, origin), sort_keys=True), time.monotonic())
                if event is not None:
                    async with asyncio.timeout(pagemodel.COMMENT_EVERY_S):
                        await response.write(event.encode())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), pagemodel.SEND_EVERY_S)
            return response
        except (ConnectionError, TimeoutError):
            return response
        finally:
            self.streams -= 1
            if self.streams == 0 and self.scraper is not None:
                self.scraper.cancel()
                self.scraper = None
                self.samples.clear()

    async def _scrape(self) -> None:
        """Each serving instance's vLLM /metrics every METRICS_EVERY_S: the two latest samples give its rates."""
        while True:
            for watched in list(self.states.watched.values()):
                if not watched.ready.serving:
                    self.samples.pop(watched.name, None)
                    continue
                sample = await self._sample(watched)
                if sample is not None:
                    self.samples[watched.name] = (self.samples.get(watched.name, (None, None))[1], sample)
            await asyncio.sleep(pagemodel.METRICS_EVERY_S)

    async def _sample(self, watched: Watched) -> pagemodel.Sample | None:
        """One read of the instance's /metrics over its own pool (aiohttp: the front's one HTTP client), marked as
        gb10d's own reads are (OWN_PARAMS), so the instance's gb10d files vLLM's access line for it at debug."""
        instance = watched.known.instance
        headers = {"authorization": f"Bearer {watched.known.api_key}"} if watched.known.api_key else {}
        url = base_url(instance.host, instance.port) + "/metrics"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            async with asyncio.timeout(2.0):
                async with watched.session.get(url, params=OWN_PARAMS, headers=headers) as answer:
                    if answer.status == 200:
                        return pagemodel.parse_metrics(await answer.text(), time.monotonic())
        return None

    # --- the actions ------------------------------------------------------------------------------------------------

    async def _act(self, request: web.BaseRequest, parts: list[str], key: ApiKey | None, keys_set: bool) -> web.Response:
        """Wake or park an on-demand instance, or restart any, through its gb10d's control socket."""
        if len(parts) != 2 or parts[1] not in pagemodel.ACTIONS:
            return self._json(error(404, f"the page's actions are POST /ui/actions/INSTANCE/{'|'.join(sorted(pagemodel.ACTIONS))}", "NotFoundError"))
        name, action = parts
        watched = self.states.watched.get(name)
        if watched is None:
            return self._json(error(404, f"no instance is named {name!r}", "NotFoundError"))
        refusal = pagemodel.may_act(
            key, keys_set, pagemodel.is_loopback(request.remote), pagemodel.ACTION_HEADER in request.headers, watched.known.instance.models,
        )
        if refusal is not None:
            return self._json(refusal)
        if action == "restart":
            return await self._restart(watched, request.remote)
        control = watched.known.control
        if control is None:
            return self._json(error(409, f"{name} is pinned (no [on_demand]): it is never woken or parked", "ConflictError"))
        # The swaps' own path: the same flags (a park holds new requests until it parked), the same journal lines.
        self.journal.say(f"asked to {action} {name} from the page ({request.remote or 'unknown client'})")
        self.swaps.ask(watched, action)
        return web.json_response({"ok": True, "instance": name, "action": action}, status=202)

    async def _restart(self, watched: Watched, client: str | None) -> web.Response:
        """Ask the instance's gb10d to restart vLLM, on the control socket every gb10d opens beside its state file."""
        path, name = control_path(watched.known.state_file), watched.name
        answer = await ask(path, "restart")
        if answer != "ok":
            why = answer or f"nothing answered on {path} (is gb10d@{name} running?)"
            return self._json(error(502, f"{name}'s gb10d did not take the restart: {why}; systemctl restart gb10d@{name} does it", "BadGatewayError"))
        self.journal.say(f"asked {name} to restart vLLM from the page ({client or 'unknown client'})")
        return web.json_response({"ok": True, "instance": name, "action": "restart"}, status=202)


def _origin(request: web.BaseRequest) -> str:
    """The front's address as the client reached it (its Host header), for commands the operator copies."""
    return f"http://{request.host}"
