"""HTTP probes of vLLM's OpenAI server: /health, /v1/models, and the model's tiny request (`tasks.Probe`).

Every httpx error is translated here into a `ProbeResult` with a short
reason, so the supervisor never sees an httpx exception and the journal
gets words like `connection refused` rather than a traceback.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import httpx

from ..base.tasks import Probe
from ..core.facts import ADMISSION_REFUSED, REFUSED, ProbeResult
from ..vllm.sleepmode import IS_SLEEPING, Call

# Every request of gb10d's to vLLM carries this query, which vLLM's routes ignore and uvicorn's access
# log prints: its lines for gb10d's own traffic are told apart by it, whatever address vLLM sees them from
# (loopback, a container's bridge), and forwarded at debug priority.
OWN_PARAMS = {"gb10d": "probe"}
OWN_QUERY = "gb10d=probe"
_OWN_ACCESS = re.compile(r':\d+ - "[A-Z]+ /[^ "?]*\?' + OWN_QUERY + r' HTTP/[\d.]+" \d{3}\b')


def own_access_line(message: str) -> bool:
    """Whether a line of vLLM's is uvicorn's access log entry for one of gb10d's own requests."""
    return OWN_QUERY in message and _OWN_ACCESS.search(message) is not None


# The words of vLLM 0.34's 503s for requests its admission limits refuse (QueueOverflowError, MaxQueuedTokensError).
_ADMISSION_WORDS = ("cannot accept new requests", "prefill token backlog limit")


def base_url(host: str, port: int) -> str:
    """Where gb10d reaches vLLM: loopback when vLLM binds every address."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Prober:
    """Probes one vLLM server; holds one connection pool for its lifetime."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # /health and /metrics are open even with --api-key; /v1 paths need the header.
        self._client = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, trust_env=False)

    async def close(self) -> None:
        await self._client.aclose()

    async def _request(
        self, method: str, path: str, timeout_s: float | None = None, params: Sequence[tuple[str, str]] = (), **kwargs: object
    ) -> tuple[httpx.Response | None, ProbeResult]:
        """One request of gb10d's own, marked so by its query (OWN_PARAMS) beside the call's own `params`."""
        start = time.monotonic()
        query = [*OWN_PARAMS.items(), *params]
        try:
            response = await self._client.request(
                method, path, params=query, timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT, **kwargs  # type: ignore[arg-type]
            )
        except httpx.ConnectError:
            # httpx reports a refused loopback connection only as "All connection attempts failed":
            # either way nothing listens on vLLM's port.
            return None, ProbeResult(None, REFUSED, time.monotonic() - start)
        except httpx.TimeoutException:
            return None, ProbeResult(None, "timed out", time.monotonic() - start)
        except httpx.HTTPError as exc:
            return None, ProbeResult(None, f"{type(exc).__name__}: {exc}", time.monotonic() - start)
        elapsed = time.monotonic() - start
        return response, ProbeResult(response.status_code, response.reason_phrase, elapsed)

    async def health(self, timeout_s: float | None = None) -> ProbeResult:
        """GET /health: 200 while the engine is alive (even if hung), 503 once it is dead."""
        _, result = await self._request("GET", "/health", timeout_s)
        return result

    async def models(self) -> ProbeResult:
        """GET /v1/models, with the served names in `models`."""
        response, result = await self._request("GET", "/v1/models")
        if response is None or response.status_code != 200:
            return result
        try:
            names = tuple(str(card["id"]) for card in response.json()["data"])
        except (ValueError, KeyError, TypeError):
            return ProbeResult(result.status, "unexpected /v1/models body", result.seconds)
        return ProbeResult(result.status, result.reason, result.seconds, names)

    async def send(self, probe: Probe, model: str, timeout_s: float) -> ProbeResult:
        """The model's tiny request (a one-token completion, a one-word embedding): proves the engine really
        runs the model (and warms the JIT).

        A 503 that vLLM's admission limits gave (its queue is full) is told
        apart from a dead engine's by the words of its body.
        """
        assert probe.route is not None, "a probe without a route sends nothing"
        response, result = await self._request("POST", probe.route, timeout_s, json=probe.body(model))
        if response is not None and response.status_code == 503 and any(words in response.text for words in _ADMISSION_WORDS):
            return ProbeResult(503, ADMISSION_REFUSED, result.seconds)
        return result

    async def call(self, call: Call, timeout_s: float) -> ProbeResult:
        """One call to vLLM's development endpoints (sleep mode): level, mode and tags in the query, as vLLM reads them."""
        _, result = await self._request(call.method, call.path, timeout_s, params=list(call.params), json=call.body)
        return result

    async def is_sleeping(self, timeout_s: float) -> tuple[ProbeResult, bool | None]:
        """GET /is_sleeping (vLLM's development endpoints): whether vLLM sleeps, None when it did not say."""
        response, result = await self._request(IS_SLEEPING.method, IS_SLEEPING.path, timeout_s)
        if response is None or not result.ok:
            return result, None
        try:
            sleeping = response.json()["is_sleeping"]
        except (ValueError, KeyError, TypeError):
            return ProbeResult(result.status, "unexpected /is_sleeping body", result.seconds), None
        return result, sleeping if isinstance(sleeping, bool) else None

    async def generate(self, model: str, prompt: str, max_tokens: int, timeout_s: float) -> str | None:
        """The text of a deterministic completion, or None when there is no good answer."""
        response, result = await self._request(
            "POST", "/v1/completions", timeout_s, json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        )
        if response is None or not result.ok:
            return None
        try:
            return str(response.json()["choices"][0]["text"])
        except (ValueError, KeyError, IndexError, TypeError):
            return None

    async def metrics_text(self, timeout_s: float = 5.0) -> str | None:
        """vLLM's own /metrics text, or None when it does not answer."""
        response, result = await self._request("GET", "/metrics", timeout_s)
        return response.text if response is not None and result.ok else None
