"""The routes of a pooling model (an embedding model, a classifier) and which routes a model's tasks open.

vLLM opens the generate routes (/v1/completions, /v1/chat/completions, ...)
only for a model whose `Supported tasks` include `generate`, and the pooling
routes only for a pooling model (`vllm/entrypoints/pooling/factories.py`):
/pooling for any pooling task, /classify for `classify`, /v1/embeddings and
/v2/embed for `embed`, /score and /rerank for a model that can score. Any
other path answers FastAPI's 404 `{"detail":"Not Found"}`. A pooled request
goes through the engine like a completion (a prefill, no generated token),
so a hung engine leaves it hanging too.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any, Sequence

from .tokens import count_prompt_tokens

if TYPE_CHECKING:
    from .api import Handler

# The routes every model serves, in the order vLLM lists them; the rest of api.ROUTES are the generate routes.
COMMON_ROUTE_COUNT = 14
_SCORE = [("/score", "POST"), ("/v1/score", "POST"), ("/rerank", "POST"), ("/v1/rerank", "POST"), ("/v2/rerank", "POST")]
EMBED_DIMENSIONS = 4096  # Qwen3-Embedding-8B's hidden size


def routes(all_routes: Sequence[tuple[str, str]], tasks: Sequence[str]) -> list[tuple[str, str]]:
    """The routes the API server lists and serves for a model with these tasks."""
    if "generate" in tasks:
        return list(all_routes)
    opened = list(all_routes[:COMMON_ROUTE_COUNT])
    if "classify" in tasks:
        opened.append(("/classify", "POST"))
    if "embed" in tasks:
        opened += [("/v1/embeddings", "POST"), ("/v2/embed", "POST")]
    opened += [*_SCORE, ("/pooling", "POST")]
    return opened


def pool(handler: Handler, path: str) -> None:
    """POST /v1/embeddings, /classify or /pooling: one engine pass over the input, then vLLM's answer body."""
    config, client = handler.server.config, handler.server.client
    try:
        body = handler.read_json()
    except ValueError as exc:
        handler.error(400, "BadRequestError", f"Invalid JSON body: {exc}")
        return
    model = body.get("model")
    if not handler.model_served(model):
        return
    text = body.get("input", "")
    prompt_tokens = count_prompt_tokens(text)
    submitted = client.submit(json.dumps(text), prompt_tokens, 1, pooling=True)
    finished = submitted is not None and any(done for _, _, done in handler.tokens(submitted[1]))
    if not finished:
        handler.error(500, "InternalServerError", "EngineCore encountered an issue. See stack trace (above) for the root cause.")
        return
    client.finish("stop")
    name = str(model or config.served_names[0])
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": None}
    handler.send_json(200, _answer(path, name, prompt_tokens, usage))


def _answer(path: str, name: str, prompt_tokens: int, usage: dict[str, Any]) -> dict[str, Any]:
    """vLLM's response body for one pooled input."""
    created = int(time.time())
    if path == "/classify":
        item: dict[str, Any] = {"index": 0, "label": "LABEL_0", "probs": [1.0], "num_classes": 1}
        return {"id": f"classify-{_hex()}", "object": "list", "created": created, "model": name, "data": [item], "usage": usage}
    vector = _unit_vector(prompt_tokens)
    if path == "/pooling":
        item = {"index": 0, "object": "pooling", "data": vector}
        return {"id": f"pool-{_hex()}", "object": "list", "created": created, "model": name, "data": [item], "usage": usage}
    item = {"index": 0, "object": "embedding", "embedding": vector}
    return {"id": f"embd-{_hex()}", "object": "list", "created": created, "model": name, "data": [item], "usage": usage}


def _unit_vector(seed: int) -> list[float]:
    """A deterministic normalised embedding, as vLLM normalises by default."""
    raw = [math.sin(seed + i) for i in range(EMBED_DIMENSIONS)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _hex() -> str:
    return time.time_ns().to_bytes(8, "big").hex()
