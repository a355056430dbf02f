"""The front's routing decisions: which paths pass, which it answers, which it refuses; the model of every request
shape; the headers vLLM gets; CORS; the back-off after a refused connect; repeated journal lines summed."""

from __future__ import annotations

import json

import pytest

from gb10d.front.core import Answer, Instance, Readiness, reconnect_delay_s, sse_comment
from gb10d.front.journal import Repeats
from gb10d.front.routes import (
    ADMIN_ROUTES,
    Forward,
    NeedMore,
    Own,
    Pass,
    adapters_of,
    cors_headers,
    kind_of,
    multipart_model,
    own_answer,
    request_fields,
    route,
    upstream_headers,
)

QWEN = Instance("qwen", ("qwen",), "127.0.0.1", 8101)
LLAMA = Instance("llama", ("llama",), "127.0.0.1", 8102)
READY = {"qwen": Readiness(True, True, "serving"), "llama": Readiness(False, True, "starting: loading_weights 3/9")}


@pytest.mark.parametrize("path", sorted(ADMIN_ROUTES) + ["/sleep?level=1", "/collective_rpc?x"])
def test_vllms_admin_routes_are_refused_with_403_saying_why(path: str) -> None:
    answer = kind_of("POST", path)
    assert isinstance(answer, Answer) and answer.status == 403 and "admin routes" in answer.message and "front.open_routes" in answer.message


def test_an_operator_may_open_one_admin_route_by_name() -> None:
    assert kind_of("POST", "/v1/load_lora_adapter", frozenset({"/v1/load_lora_adapter"})) == Pass()
    assert isinstance(kind_of("POST", "/sleep", frozenset({"/v1/load_lora_adapter"})), Answer)


@pytest.mark.parametrize("path", [
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/responses/resp_1/cancel", "/v1/messages",
    "/v1/messages/count_tokens", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize",
    "/detokenize", "/v1/audio/transcriptions", "/v1/audio/translations", "/invocations", "/version",
])
def test_the_inference_routes_pass(path: str) -> None:
    assert kind_of("POST", path) == Pass()


@pytest.mark.parametrize("path", ["/health", "/ping", "/v1/models", "/v1/models/qwen", "/health?x=1"])
def test_health_and_the_model_list_are_the_fronts_own(path: str) -> None:
    assert kind_of("GET", path) == Own()


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/metrics", "/", "/v1/other"])
def test_anything_else_is_404_naming_what_passes(path: str) -> None:
    answer = kind_of("GET", path)
    assert isinstance(answer, Answer) and answer.status == 404 and "not a route this endpoint serves" in answer.message


def test_one_models_card_is_answered_by_the_front_and_an_unknown_one_is_404() -> None:
    card = own_answer("GET", "/v1/models/llama", (QWEN, LLAMA), READY, 1000.0)
    assert card.status == 200 and card.body["id"] == "llama" and card.body["gb10d_state"] == "starting: loading_weights 3/9"
    missing = own_answer("GET", "/v1/models/gpt-4", (QWEN, LLAMA), READY, 1000.0)
    assert missing.status == 404 and "llama, qwen" in missing.message
    restricted = own_answer("GET", "/v1/models/qwen", (QWEN, LLAMA), READY, 1000.0, frozenset({"llama"}))
    assert restricted.status == 404


def test_a_json_body_without_a_content_type_is_read_for_its_model_and_stream() -> None:
    body = json.dumps({"model": "llama", "stream": True}).encode()
    assert request_fields(body, "") == ("llama", True, None)
    assert request_fields(body, "text/plain") == (None, False, None)
    assert request_fields(b"not json", "") == (None, False, None)


FORM = (
    b"--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nllama\r\n"
    b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF...."
)


def test_a_multipart_forms_model_is_found_in_its_first_bytes_and_the_file_need_not_be_read() -> None:
    ctype = 'multipart/form-data; boundary="xyz"'
    assert multipart_model(FORM, ctype, False) == "llama"
    assert multipart_model(FORM[:30], ctype, False) == NeedMore()
    assert multipart_model(FORM[:FORM.index(b"llama") + 3], ctype, False) == NeedMore(), "a value cut off before its line ends is not a model yet"
    assert multipart_model(b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\ndata\r\n--xyz--\r\n", ctype, True) is None
    assert route("POST", "/v1/audio/transcriptions", b"", "", (QWEN, LLAMA), READY, 0.0, model="llama") == Forward(LLAMA)


def test_a_lora_adapter_goes_to_its_base_models_instance() -> None:
    listed = {"data": [{"id": "llama", "parent": None}, {"id": "sql-lora", "parent": "llama"}, {"id": 5}]}
    adapters = adapters_of("llama", listed)
    assert adapters == {"sql-lora": "llama"}
    body = json.dumps({"model": "sql-lora"}).encode()
    assert route("POST", "/v1/completions", body, "application/json", (QWEN, LLAMA), READY, 0.0, adapters=adapters) == Forward(LLAMA)
    denied = route("POST", "/v1/completions", body, "application/json", (QWEN, LLAMA), READY, 0.0, frozenset({"qwen"}), adapters)
    assert isinstance(denied, Answer) and denied.status == 403 and "may not use sql-lora" in denied.message


def test_a_request_naming_no_model_among_several_instances_gets_400_saying_why() -> None:
    answer = route("GET", "/version", b"", "", (QWEN, LLAMA), READY, 0.0)
    assert isinstance(answer, Answer) and answer.status == 400 and "serves several: llama, qwen" in answer.message


def test_vllm_gets_the_instances_key_forwarded_for_and_never_the_clients_credentials() -> None:
    given = [(b"Authorization", b"Bearer front-key"), (b"X-Api-Key", b"k"), (b"X-Forwarded-For", b"10.0.0.9"), (b"Host", b"gb10.lan"), (b"Content-Type", b"application/json")]
    out = upstream_headers(given, "192.0.2.7", "gb10.lan", "instance-key", strip_credentials=True)
    assert (b"authorization", b"Bearer instance-key") in out and (b"authorization", b"Bearer front-key") not in out
    assert all(name != b"x-api-key" for name, _ in out)
    assert (b"x-forwarded-for", b"10.0.0.9, 192.0.2.7") in out and (b"x-forwarded-proto", b"http") in out and (b"x-forwarded-host", b"gb10.lan") in out
    assert all(name != b"host" for name, _ in out)
    # Without keys at the front and none for the instance, the client's own credentials are the instance's business.
    passed = upstream_headers(given, "192.0.2.7", None, None, strip_credentials=False)
    assert (b"authorization", b"Bearer front-key") in passed


def test_cors_headers_only_for_the_origins_the_operator_allowed() -> None:
    assert cors_headers("https://app.example", [], False) == {}
    assert cors_headers("https://evil.example", ["https://app.example"], False) == {}
    allowed = cors_headers("https://app.example", ["https://app.example"], True, "content-type")
    assert allowed["access-control-allow-origin"] == "https://app.example" and allowed["access-control-allow-headers"] == "content-type"
    assert cors_headers("https://any.example", ["*"], False)["access-control-allow-origin"] == "*"


def test_a_refused_connect_is_retried_after_a_back_off_that_grows_to_two_seconds() -> None:
    delays = [reconnect_delay_s(n) for n in range(1, 9)]
    assert delays[0] == pytest.approx(0.1) and delays == sorted(delays) and max(delays) == 2.0


def test_a_held_streams_comment_is_one_sse_comment_line() -> None:
    assert sse_comment("qwen is starting\nloading") == b": qwen is starting loading\n\n"


def test_repeats_of_one_cause_are_said_once_then_summed_each_interval() -> None:
    repeats = Repeats(interval_s=10.0)
    said = [repeats.offer("rejected", f"line {i}", now=float(i) / 100) for i in range(744)]
    assert said.count(True) == 1
    assert repeats.due(5.0) == []
    summary = repeats.due(10.0)
    assert len(summary) == 1 and summary[0][0] == "line 743" and summary[0][1] == 743
    assert repeats.due(20.0) == [] and repeats.offer("rejected", "again", 31.0) is True
