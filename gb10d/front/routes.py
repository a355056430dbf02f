"""Which requests the front passes, where, and with which headers: decided from the request line, the headers and
the body's first bytes, free of I/O.

The front is the machine's public door, so it passes an allow list: the inference routes vLLM serves. vLLM's admin
and development routes (`/sleep`, `/collective_rpc`, ...) control the server, not a request; anyone who reaches the
door could otherwise put a model to sleep or call a method on its workers. They are answered here and never reach
vLLM, unless the operator opens one by name (`front.open_routes`).
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .core import Answer, Instance, Readiness, error, model_list

# Paths the front answers itself: a load balancer's health check must not wake or wait for any model.
FRONT_HEALTH = frozenset({"/health", "/ping"})
MODELS = "/v1/models"

# The inference routes of vLLM 0.23-0.34 (generate and pooling models alike); a route a model does not serve is
# answered by its vLLM (404), as it would be without the front.
PUBLIC_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/chat/completions/render", "/v1/completions",
    "/v1/completions/render", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings",
    "/pooling", "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/tokenize", "/detokenize", "/v1/audio/transcriptions", "/v1/audio/translations", "/invocations",
    "/inference/v1/generate", "/generative_scoring", "/version",
})
# Routes under which every path is public: a stored response and its cancel (`/v1/responses/{id}[/cancel]`).
PUBLIC_PREFIXES = ("/v1/responses/",)
# vLLM's routes that control the server (section 16 of the reference: dev mode, LoRA loading, profiling, elastic EP).
ADMIN_ROUTES = frozenset({
    "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/pause", "/resume", "/init_weight_transfer_engine", "/update_weights", "/server_info",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/load",
})

# RFC 9110 §7.6.1: meaningful for one connection only; a proxy never forwards them. `Connection` may name more.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
})
# What a client proves itself with at the front: the front's key, not the instance's, so it stops here.
CREDENTIALS = frozenset({"authorization", "x-api-key"})
# Set afresh by the front for each hop.
REWRITTEN = frozenset({"host", "content-length", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})


@dataclass(frozen=True)
class Forward:
    instance: Instance


Route = Forward | Answer


@dataclass(frozen=True)
class Own:
    """A path the front answers itself (health, the model list, one model's card)."""


@dataclass(frozen=True)
class Pass:
    """An inference route: routed by its model to an instance."""


PathKind = Own | Pass | Answer


def bare(path: str) -> str:
    """The path without its query."""
    return path.split("?", 1)[0]


def kind_of(method: str, path: str, open_routes: frozenset[str] = frozenset()) -> PathKind:
    """Whether the front answers the path itself, passes it on, or refuses it (an admin route: 403; anything else
    vLLM might serve but that is not an inference route: 404), before any header or body is read."""
    where = bare(path)
    if where in FRONT_HEALTH or where == MODELS or where.startswith(MODELS + "/"):
        return Own()
    if where in PUBLIC_ROUTES or where in open_routes or where.startswith(PUBLIC_PREFIXES):
        return Pass()
    if where in ADMIN_ROUTES:
        return error(
            403, f"{where} is one of vLLM's admin routes, which this endpoint does not pass: gb10d parks and wakes models "
            "itself; reach it on the instance's own address, or open it with front.open_routes", "PermissionDeniedError",
        )
    return error(404, f"{where} is not a route this endpoint serves (method {method}): it passes vLLM's inference routes (README: the front)", "NotFoundError")


def own_answer(
    method: str, path: str, instances: Sequence[Instance], readiness: Mapping[str, Readiness], now: float, allowed: frozenset[str] = frozenset(),
) -> Answer:
    """The front's own answer: its health, /v1/models (each model with its instance's state), or one model's card."""
    where = bare(path)
    if method not in ("GET", "HEAD") and not (where == "/ping" and method == "POST"):
        return error(405, f"{where} answers GET", "MethodNotAllowedError")
    if where in FRONT_HEALTH:
        return Answer(200, {"status": "ok"})
    listed = model_list(instances, readiness, now, allowed)
    if where == MODELS:
        return listed
    wanted = where[len(MODELS) + 1:]
    cards = listed.body["data"]
    assert isinstance(cards, list)
    for card in cards:
        if card["id"] == wanted:
            return Answer(200, card)
    served = ", ".join(sorted(card["id"] for card in cards)) or "none"
    return error(404, f"The model `{wanted}` does not exist. This endpoint serves: {served}.", "NotFoundError")


def forwarded_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers a proxy passes on: all but hop-by-hop ones, those `Connection` names, and Host and Content-Length
    (set for the connection it writes to)."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {token.strip().lower() for name, value in pairs if name == b"connection" for token in value.split(b",")}
    dropped = {h.encode() for h in HOP_BY_HOP} | named | {b"host", b"content-length"}
    return [(name, value) for name, value in pairs if name not in dropped]


def upstream_headers(
    headers: Iterable[tuple[bytes, bytes]], client: str | None, host: str | None, instance_key: str | None, strip_credentials: bool,
) -> list[tuple[bytes, bytes]]:
    """The request's headers as the instance gets them: hop-by-hop ones dropped; the client's credentials dropped
    when the front checked them (its keys are not the instance's) or the instance has a key of its own, which is
    added; X-Forwarded-For extended with the client's address, X-Forwarded-Proto and -Host set."""
    passed = forwarded_headers(headers)
    prior = b", ".join(value for name, value in passed if name == b"x-forwarded-for")
    drop = {n.encode() for n in REWRITTEN} | ({n.encode() for n in CREDENTIALS} if strip_credentials or instance_key else set())
    out = [(name, value) for name, value in passed if name not in drop]
    if client:
        out.append((b"x-forwarded-for", prior + b", " + client.encode() if prior else client.encode()))
    out.append((b"x-forwarded-proto", b"http"))
    if host:
        out.append((b"x-forwarded-host", host.encode("latin-1", "replace")))
    if instance_key:
        out.append((b"authorization", b"Bearer " + instance_key.encode()))
    return out


@dataclass(frozen=True)
class ApiKey:
    """A key clients may send, and the models it may use (none named: every model)."""

    secret: bytes
    models: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entry: str) -> ApiKey:
        """`KEY`, or `KEY MODEL...` for a key restricted to those models (keys hold no spaces)."""
        secret, *models = entry.split()
        return cls(secret.encode(), frozenset(models))


def authorized(path: str, headers: Iterable[tuple[bytes, bytes]], keys: Sequence[ApiKey]) -> ApiKey | Answer | None:
    """The key the request carries, None when it needs none (no keys are set, or it is the front's health), or 401.

    Decided on the headers alone, before `100 Continue` and before a byte of the body is read. Every key is
    compared, each in constant time, so neither a key nor which one matched leaks through timing."""
    if not keys or bare(path) in FRONT_HEALTH:
        return None
    given = b""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
        elif name == b"x-api-key":
            given = value.strip()
    matched: ApiKey | None = None
    for key in keys:
        if hmac.compare_digest(given, key.secret) and matched is None:
            matched = key
    if matched is not None:
        return matched
    return error(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)", "AuthenticationError")


def looks_like_json(body: bytes, content_type: str) -> bool:
    """A JSON body: said so, or sent without a Content-Type (curl -d, many scripts) and starting like an object."""
    if "json" in content_type.lower():
        return True
    return not content_type.strip() and body.lstrip()[:1] == b"{"


def request_fields(body: bytes, content_type: str) -> tuple[str | None, bool, Answer | None]:
    """The request's `model` field (None when the body names none), whether it asks for a stream
    (`"stream": true`), or a 400 for a JSON body that is not JSON."""
    if not body.strip() or not looks_like_json(body, content_type):
        return None, False, None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, False, error(400, f"the request body is not valid JSON: {exc}", "BadRequestError")
    if not isinstance(parsed, dict):
        return None, False, error(400, "the request body must be a JSON object", "BadRequestError")
    stream = parsed.get("stream") is True
    model = parsed.get("model")
    if model is None:
        return None, stream, None
    if not isinstance(model, str):
        return None, False, error(400, f'"model" must be a string (got {json.dumps(model)})', "BadRequestError")
    return model, stream, None


def model_of(body: bytes, content_type: str) -> tuple[str | None, Answer | None]:
    """The request's `model` field, or None when the body names none, or a 400 for a JSON body that is not JSON."""
    model, _, problem = request_fields(body, content_type)
    return model, problem


@dataclass(frozen=True)
class NeedMore:
    """The multipart prefix read so far does not yet show the `model` field."""


_FIELD_NAME = re.compile(rb'(?i)content-disposition:[^\r\n]*?\bname="([^"]*)"')


def multipart_model(prefix: bytes, content_type: str, complete: bool) -> str | NeedMore | None:
    """The `model` form field of a multipart body (audio transcriptions) from the body's first bytes, so that the
    rest, a file of any size, streams through unread; None when the body (`complete`) has no such field."""
    match = re.search(r'(?i)boundary="?([^";]+)"?', content_type)
    if match is None:
        return None
    delimiter = b"--" + match.group(1).encode("latin-1", "replace")
    for part in prefix.split(delimiter)[1:]:
        head, sep, value = part.partition(b"\r\n\r\n")
        name = _FIELD_NAME.search(head)
        if name is None or name.group(1) != b"model":
            continue
        if not sep or (not value.endswith(b"\r\n") and not complete):
            # The field's value is cut off here: the next part's delimiter has not arrived yet.
            return NeedMore()
        return value.removesuffix(b"\r\n").decode("utf-8", "replace").strip()
    return None if complete else NeedMore()


def is_multipart(content_type: str) -> bool:
    return content_type.lower().startswith("multipart/form-data")


def route(
    method: str, path: str, body: bytes, content_type: str, instances: Sequence[Instance], readiness: Mapping[str, Readiness], now: float,
    allowed: frozenset[str] = frozenset(), adapters: Mapping[str, str] | None = None, model: str | None = None,
) -> Route:
    """Where a request goes: the instance serving its `model` (or the LoRA adapter's base model, `adapters`:
    adapter -> instance name), or the only instance when it names none, or an answer (the front's own health and
    model list among them). `model`: the model read beforehand (a multipart form field); `allowed`: the models the
    request's key may use (empty: every model); a restricted key sees only those, and gets 403 for the others."""
    if isinstance(kind_of(method, path), Own):
        return own_answer(method, path, instances, readiness, now, allowed)
    if model is None:
        model, problem = model_of(body, content_type)
        if problem is not None:
            return problem
    served = sorted(name for instance in instances for name in instance.models if not allowed or name in allowed)
    if model is None:
        if len(instances) == 1:
            return _permitted(Forward(instances[0]), allowed, instances[0].models, ", ".join(instances[0].models))
        return error(
            400, f'the request names no "model" (in its JSON body, or a form field), and this endpoint serves several: '
            f'{", ".join(served) or "no model"}', "BadRequestError",
        )
    for instance in instances:
        if model in instance.models:
            return _permitted(Forward(instance), allowed, (model,), model)
    base = (adapters or {}).get(model)
    for instance in instances:
        if instance.name == base:
            return _permitted(Forward(instance), allowed, (model, *instance.models), model)
    return error(404, f"The model `{model}` does not exist. This endpoint serves: {', '.join(served) or 'none'}.", "NotFoundError")


def _permitted(forward: Forward, allowed: frozenset[str], asked: Sequence[str], named: str) -> Route:
    """`forward` when the key may use one of the models `asked` for (an adapter: its base model's too), else 403
    naming what was asked for (`named`) and what it may use."""
    if not allowed or allowed.intersection(asked):
        return forward
    return error(403, f"this API key may not use {named}; it may use {', '.join(sorted(allowed))}", "PermissionDeniedError")


def adapters_of(instance: str, models_body: object) -> dict[str, str]:
    """The LoRA adapters an instance's vLLM lists in its /v1/models (cards with a `parent`), each mapped to the
    instance: a request names an adapter, and the front sends it to the base model's instance."""
    data = models_body.get("data") if isinstance(models_body, dict) else None
    if not isinstance(data, list):
        return {}
    return {
        card["id"]: instance for card in data
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card.get("parent")
    }


CORS_METHODS = "GET, POST, OPTIONS"


def cors_headers(origin: str | None, allowed_origins: Sequence[str], preflight: bool, asked_headers: str = "") -> dict[str, str]:
    """The CORS headers for a request from a page of `origin`: none unless the operator allowed that origin
    (`front.cors_origins`, "*" for any); a preflight also gets the methods and the headers it asked for."""
    if origin is None or not allowed_origins or ("*" not in allowed_origins and origin not in allowed_origins):
        return {}
    headers = {"access-control-allow-origin": origin if "*" not in allowed_origins else "*", "vary": "Origin"}
    if preflight:
        headers["access-control-allow-methods"] = CORS_METHODS
        headers["access-control-allow-headers"] = asked_headers or "authorization, content-type, x-api-key"
        headers["access-control-max-age"] = "600"
    return headers
