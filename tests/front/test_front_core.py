"""The front's decisions: routing by model, hop-by-hop headers, holding or refusing while an instance is not serving."""

from __future__ import annotations

import itertools
import json

import pytest

from gb10d.core.statefile import DaemonState, Progress, StateRecord
from gb10d.front.core import Answer, Go, Instance, Readiness, Wait, admit, readiness_of, sse_error_event
from gb10d.front.routes import ApiKey, Forward, authorized, forwarded_headers, model_of, route

QWEN = Instance("qwen", ("qwen", "qwen-fast"), "127.0.0.1", 8101)
LLAMA = Instance("llama", ("llama",), "127.0.0.1", 8102)
SERVING = Readiness(serving=True, coming=True, detail="serving")
LOADING = Readiness(serving=False, coming=True, detail="starting: loading_weights 12/66")
STOPPED = Readiness(serving=False, coming=False, detail="not running (state is stopped)")
READY = {"qwen": SERVING, "llama": LOADING}
JSON = "application/json"


def chat(model: object) -> bytes:
    return json.dumps({"model": model, "messages": []}).encode()


def go(body: bytes, instances: tuple[Instance, ...] = (QWEN, LLAMA), method: str = "POST", path: str = "/v1/chat/completions", ctype: str = JSON) -> Forward | Answer:
    return route(method, path, body, ctype, instances, READY, 1000.0)


@pytest.mark.parametrize("model,instance", [("qwen", QWEN), ("qwen-fast", QWEN), ("llama", LLAMA)])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/tokenize"])
def test_a_request_goes_to_the_instance_serving_its_model_on_every_path(model: str, instance: Instance, path: str) -> None:
    assert go(chat(model), path=path) == Forward(instance)


def test_an_unknown_model_gets_404_naming_the_models_served() -> None:
    answer = go(chat("gpt-4"))
    assert isinstance(answer, Answer) and answer.status == 404
    assert "`gpt-4` does not exist" in answer.message and "llama, qwen, qwen-fast" in answer.message


@pytest.mark.parametrize("body,words", [
    (b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (chat(5), '"model" must be a string'), (b"\xff\xfe", "not valid JSON"),
])
def test_a_malformed_body_gets_400_that_says_what_is_wrong(body: bytes, words: str) -> None:
    answer = go(body)
    assert isinstance(answer, Answer) and answer.status == 400 and words in answer.message
    assert answer.body["error"]["type"] == "BadRequestError"  # type: ignore[index]


def test_a_request_without_a_model_goes_to_the_only_instance_and_is_refused_among_several() -> None:
    assert go(b"", (QWEN,), method="GET", path="/version") == Forward(QWEN)
    assert go(b'{"prompt": "x"}', (QWEN,)) == Forward(QWEN)
    answer = go(b'{"prompt": "x"}')
    assert isinstance(answer, Answer) and answer.status == 400 and 'names no "model"' in answer.message


def test_a_body_that_is_not_json_is_not_parsed_for_a_model() -> None:
    assert go(b"{not json", (QWEN,), ctype="multipart/form-data; boundary=x") == Forward(QWEN)


def test_health_and_the_model_list_are_the_fronts_own_answers() -> None:
    assert go(b"", method="GET", path="/health") == Answer(200, {"status": "ok"})
    listed = go(b"", method="GET", path="/v1/models?x=1")
    assert isinstance(listed, Answer) and listed.status == 200
    states = {m["id"]: (m["gb10d_instance"], m["gb10d_state"]) for m in listed.body["data"]}  # type: ignore[attr-defined]
    assert states == {"qwen": ("qwen", "serving"), "qwen-fast": ("qwen", "serving"), "llama": ("llama", "starting: loading_weights 12/66")}


def test_model_of_reads_only_json_bodies() -> None:
    assert model_of(chat("qwen"), "application/json; charset=utf-8") == ("qwen", None)
    assert model_of(b"  ", JSON) == (None, None)
    assert model_of(b'{"input": "x"}', JSON) == (None, None)


def test_hop_by_hop_headers_and_those_connection_names_are_dropped() -> None:
    headers = [
        (b"Authorization", b"Bearer k"), (b"Connection", b"keep-alive, X-Private"), (b"X-Private", b"1"), (b"Keep-Alive", b"5"),
        (b"Transfer-Encoding", b"chunked"), (b"TE", b"trailers"), (b"Upgrade", b"h2c"), (b"Host", b"front"), (b"Content-Length", b"9"),
        (b"Content-Type", b"application/json"), (b"Proxy-Authorization", b"x"), (b"X-Request-Id", b"abc"),
    ]
    assert forwarded_headers(headers) == [(b"authorization", b"Bearer k"), (b"content-type", b"application/json"), (b"x-request-id", b"abc")]


def test_a_serving_instance_lets_every_request_through_whatever_the_queue() -> None:
    for held, waited, newly in itertools.product((0, 5, 10_000), (0.0, 1e6), (True, False)):
        assert admit(QWEN, SERVING, held, 10, waited, 60.0, newly) == Go()


def test_a_loading_instance_holds_requests_until_the_bound_or_the_timeout() -> None:
    assert admit(QWEN, LOADING, 9, 10, 0.0, 60.0, True) == Wait()
    assert admit(QWEN, LOADING, 10, 10, 59.9, 60.0, False) == Wait()  # already counted among the held
    full = admit(QWEN, LOADING, 10, 10, 0.0, 60.0, True)
    late = admit(QWEN, LOADING, 3, 10, 60.0, 60.0, False)
    for answer, why in ((full, "10 requests already wait for it (front.queue_limit)"), (late, "waited 60 s (front.hold_timeout_s)")):
        assert isinstance(answer, Answer) and answer.status == 503 and answer.retry_after_s is not None
        assert answer.message.startswith("qwen is starting: loading_weights 12/66") and why in answer.message


def test_a_stopped_instance_is_not_waited_for() -> None:
    answer = admit(QWEN, STOPPED, 0, 10, 0.0, 60.0, True)
    assert isinstance(answer, Answer) and answer.status == 503 and "systemctl start gb10d@qwen" in answer.message


@pytest.mark.parametrize("state,alive,serving,coming,detail", [
    (None, False, False, False, "not running (no state file)"),
    (StateRecord(pid=1, state=DaemonState.SERVING), True, True, True, "serving"),
    (StateRecord(pid=1, state=DaemonState.STOPPED), False, False, False, "not running (pid 1 has exited)"),
    (StateRecord(pid=1, state=DaemonState.FAILED), True, False, False, "not running (state is failed)"),
    (StateRecord(pid=1, state=DaemonState.STARTING, phase="loading_weights", progress=Progress(12, 66)), True, False, True, "starting: loading_weights 12/66"),
    (StateRecord(pid=1, state=DaemonState.RESTARTING), True, False, True, "restarting"),
    (StateRecord(pid=1, state=DaemonState.WAITING_FOR_MEMORY), True, False, True, "waiting for memory"),
])
def test_readiness_comes_from_the_state_file_and_the_pid(state: StateRecord | None, alive: bool, serving: bool, coming: bool, detail: str) -> None:
    assert readiness_of(state, alive) == Readiness(serving, coming, detail)


def test_the_error_event_of_a_broken_stream_is_one_sse_event() -> None:
    event = sse_error_event("qwen stopped")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1])["error"]["message"] == "qwen stopped"


KEYS = (ApiKey(b"k" * 16), ApiKey(b"second-key-0123456789", frozenset({"llama"})))


@pytest.mark.parametrize("headers,passes", [
    ([(b"Authorization", b"Bearer " + b"k" * 16)], KEYS[0]),
    ([(b"authorization", b"bearer second-key-0123456789")], KEYS[1]),
    ([(b"x-api-key", b"second-key-0123456789")], KEYS[1]),
    ([(b"Authorization", b"Bearer " + b"k" * 15)], None),
    ([(b"Authorization", b"Basic " + b"k" * 16)], None),
    ([], None),
])
def test_with_api_keys_only_a_request_carrying_one_passes_and_is_known_by_its_key(headers: list[tuple[bytes, bytes]], passes: ApiKey | None) -> None:
    answer = authorized("/v1/chat/completions", headers, KEYS)
    if passes is not None:
        assert answer == passes
    else:
        assert isinstance(answer, Answer) and answer.status == 401 and b"k" * 15 not in json.dumps(answer.body).encode()


def test_without_api_keys_or_for_health_every_request_passes() -> None:
    assert authorized("/v1/models", [], ()) is None
    assert authorized("/health?x", [], KEYS) is None


def test_an_api_key_entry_names_the_models_it_may_use() -> None:
    assert ApiKey.parse("  second-key-0123456789 llama  qwen ") == ApiKey(b"second-key-0123456789", frozenset({"llama", "qwen"}))
    assert ApiKey.parse("k" * 16) == ApiKey(b"k" * 16, frozenset())


def test_a_key_restricted_to_some_models_reaches_only_those_and_sees_only_those() -> None:
    only_llama = frozenset({"llama"})

    def keyed(body: bytes, instances: tuple[Instance, ...] = (QWEN, LLAMA), path: str = "/v1/chat/completions", method: str = "POST") -> Forward | Answer:
        return route(method, path, body, JSON, instances, READY, 1000.0, only_llama)

    assert keyed(chat("llama")) == Forward(LLAMA)
    denied = keyed(chat("qwen-fast"))
    assert isinstance(denied, Answer) and denied.status == 403
    assert denied.message == "this API key may not use qwen-fast; it may use llama"
    unknown = keyed(chat("gpt-4"))
    assert isinstance(unknown, Answer) and unknown.status == 404 and unknown.message.endswith("This endpoint serves: llama.")
    alone = keyed(b"", instances=(QWEN,))
    assert isinstance(alone, Answer) and alone.status == 403
    assert keyed(b"", instances=(LLAMA,)) == Forward(LLAMA)
    listed = keyed(b"", path="/v1/models", method="GET")
    assert isinstance(listed, Answer) and [m["id"] for m in listed.body["data"]] == ["llama"]  # type: ignore[index, union-attr]
