"""The development endpoints (VLLM_SERVER_DEV_MODE=1) of the stand-in's API server: vLLM 0.26's sleep routes
(entrypoints/serve/dev/sleep/api_router.py) and collective_rpc, answered once the EngineCore is done."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, Protocol

# VLLM_SERVER_DEV_MODE=1 adds these (REFERENCE §18); the stand-in simulates the sleep ones, reload_weights and the cache resets (no-ops).
DEV_ROUTES = [
    ("/reset_prefix_cache", "POST"), ("/reset_mm_cache", "POST"), ("/reset_encoder_cache", "POST"), ("/pause", "POST"),
    ("/resume", "POST"), ("/is_paused", "GET"), ("/collective_rpc", "POST"), ("/server_info", "GET"), ("/sleep", "POST"),
    ("/wake_up", "POST"), ("/is_sleeping", "GET"),
]
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class DevHandler(Protocol):
    """What of the API server's request handler the routes use."""

    path: str
    server: Any

    def _body(self) -> Any: ...

    def _send(self, status: int, body: bytes = b"", content_type: str | None = ...) -> None: ...

    def error(self, status: int, kind: str, message: str) -> None: ...


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def dev_route(handler: DevHandler, method: str, path: str) -> bool:
    """The sleep endpoints as vLLM's api_router has them: level and mode from the query (not the body), tags
    repeated; 200 with an empty body once the engine is done. False for any other route."""
    query = urllib.parse.parse_qs(handler.path.partition("?")[2])
    if path == "/sleep" and method == "POST":
        message: dict[str, Any] = {"t": "sleep", "level": int(query.get("level", ["1"])[0]), "mode": query.get("mode", ["abort"])[0]}
    elif path == "/wake_up" and method == "POST":
        tags = query.get("tags") or None
        handler.server.console.log("INFO", "entrypoints/serve/dev/sleep/api_router.py:37", f"wake up the engine with tags: {tags}")
        message = {"t": "wake_up", "tags": tags}
    elif path == "/is_sleeping" and method == "GET":
        message = {"t": "is_sleeping"}
    elif path == "/collective_rpc" and method == "POST":
        try:
            body = handler._body()
        except ValueError as exc:
            handler._send(400, _dumps({"detail": f"JSON decode error: {exc}"}))
            return True
        if not isinstance(body, dict) or body.get("method") is None:
            handler._send(400, _dumps({"detail": "Missing 'method' in request body"}))
            return True
        message = {"t": "rpc", "method": body["method"]}
    elif path in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache") and method == "POST":
        handler._send(200, content_type=None)  # the stand-in keeps no cache to reset
        return True
    else:
        return False
    answer = handler.server.client.control(message)
    if answer is None or answer.get("error"):
        why = answer.get("error") if answer else "EngineCore encountered an issue. See stack trace (above) for the root cause."
        handler.error(500, "InternalServerError", str(why))
    elif path == "/is_sleeping":
        handler._send(200, _dumps({"is_sleeping": bool(answer.get("is_sleeping"))}))
    elif path == "/collective_rpc":
        handler._send(200, _dumps({"results": answer.get("results", [])}))
    else:
        handler._send(200, content_type=None)
    return True
