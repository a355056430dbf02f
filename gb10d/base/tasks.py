"""Which request proves that a model serves: the warm-up before READY=1 and the idle liveness probe after it.

vLLM opens only the routes of the tasks its model supports, and says which
before it listens: `Supported tasks: ['generate']` for a model that
generates, `['embed', 'token_embed']` for an embedding model, `['classify']`
for a classifier or a cross-encoder. A pooling model answers 404 to
/v1/completions, so a completion can neither warm it up nor prove it alive.
The request is chosen here from those tasks, or named by the operator
(`liveness.probe_route`); pure, so that every choice is a table test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

COMPLETIONS = "/v1/completions"

ProbeRoute = Literal["auto", "/v1/completions", "/v1/embeddings", "/classify", "/pooling", "none"]
PROBE_ROUTES: tuple[str, ...] = get_args(ProbeRoute)

# vLLM's tasks (`vllm/tasks.py`, the same from 0.23 to 0.34), in the order a model that has several is probed by,
# with the route that serves each and the `task` a /pooling request names.
_BY_TASK: tuple[tuple[str, str, str | None], ...] = (
    ("generate", COMPLETIONS, None),
    ("embed", "/v1/embeddings", None),
    ("embed&token_classify", "/v1/embeddings", None),
    ("classify", "/classify", None),
    ("token_embed", "/pooling", "token_embed"),
    ("token_classify", "/pooling", "token_classify"),
)
# What a request to each route is called in the journal: "warm-up completion took 0.05 s".
_NOUNS = {COMPLETIONS: "completion", "/v1/embeddings": "embedding", "/classify": "classification", "/pooling": "pooling request"}


@dataclass(frozen=True)
class Probe:
    """One tiny request to `route` (None: no request is sent), with the /pooling `task` it names if any."""

    route: str | None
    task: str | None = None

    @property
    def noun(self) -> str:
        """The request in words, for the journal."""
        return _NOUNS.get(self.route or "", "request")

    @property
    def words(self) -> str:
        """The request with its size, for the liveness evidence: "a 1-token completion"."""
        return "a 1-token completion" if self.route == COMPLETIONS else f"a one-word {self.noun}"

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body: one token generated, or one word pooled."""
        if self.route == COMPLETIONS:
            return {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        body: dict[str, Any] = {"model": model, "input": "Hi"}
        if self.task is not None:
            body["task"] = self.task
        return body


def choose(setting: str, tasks: tuple[str, ...] | None) -> Probe:
    """The probe for a model: the operator's route, else the first of its tasks a route serves.

    Tasks not seen (a vLLM that did not say them, or whose logging is off)
    mean a completion, as for every model before pooling models were told
    apart; tasks that no tiny request serves (transcription, realtime, a
    plugin's) mean none: /health and /metrics then are the only evidence.
    """
    if setting == "none":
        return Probe(None)
    if setting != "auto":
        return Probe(setting)
    if tasks is None:
        return Probe(COMPLETIONS)
    for task, route, pooling_task in _BY_TASK:
        if task in tasks:
            return Probe(route, pooling_task)
    return Probe(None)
