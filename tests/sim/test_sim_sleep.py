"""The stand-in's sleep mode behaves as vLLM 0.26's on GB10 (REFERENCE §18): the development endpoints exist only
with VLLM_SERVER_DEV_MODE=1, level and tags come from the query, level 2 gives the memory back and a wake takes it
again, a wake without reload_weights answers 200 with empty text, level 1 keeps a host copy of the weights."""

from __future__ import annotations

import json
import threading
from http.client import HTTPConnection
from pathlib import Path

from gb10d.base.units import GIB
from gb10d.machine.memory import read_meminfo
from gb10d.sim.memory import adjust
from sim_support import Reply, StartSim, http
from test_sim_memory import machine

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def complete(port: int) -> str:
    reply = http(port, "/v1/completions", {"model": "m", "prompt": "Say something", "max_tokens": 4, "temperature": 0})
    assert reply.status == 200, reply.body
    return str(reply.json()["choices"][0]["text"])


def sleep_gauge(port: int) -> str:
    lines = [line for line in http(port, "/metrics").body.decode().splitlines() if line.startswith("vllm:engine_sleep_state") and line.endswith(" 1.0")]
    assert len(lines) == 1, lines
    return lines[0].split('sleep_state="')[1].split('"')[0]


def test_without_dev_mode_the_sleep_endpoints_do_not_exist(sim: StartSim) -> None:
    s = sim("m", "--enable-sleep-mode")
    s.wait_ready()
    assert http(s.port, "/sleep?level=2", {}).status == 404
    assert http(s.port, "/is_sleeping").status == 404
    s.wait_text("Route: /v1/completions")  # stdout is read by a thread of its own: its start is all in once the routes are
    assert b"Enabling cumem allocator because sleep mode requires it." in s.stdout
    assert b"SECURITY WARNING" not in s.stdout


def test_level_2_sleep_gives_the_memory_back_and_the_tagged_wake_with_reload_answers_as_before(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    s = sim("m", "--enable-sleep-mode", "--gpu-memory-utilization", "0.5", env={**DEV, "GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_ready()
    s.wait_text("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!")
    before = complete(s.port)
    awake = read_meminfo(meminfo).available
    assert http(s.port, "/sleep?level=2&mode=wait", {}).status == 200
    assert http(s.port, "/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_gauge(s.port) == "discard_all"
    asleep = read_meminfo(meminfo).available
    freed = asleep - awake
    assert freed > 55 * GIB, "all but what the CUDA context keeps comes back"
    s.wait_text(f"Sleep mode freed {round(freed / GIB, 2)} GiB memory, 1.66 GiB memory is still in use.")
    s.wait_text("seconds to fall asleep.")
    assert http(s.port, "/health").status == 200, "health stays green while asleep"
    assert http(s.port, "/wake_up?tags=weights", {}).status == 200
    s.wait_text("wake up the engine with tags: ['weights']")
    assert http(s.port, "/collective_rpc", {"method": "reload_weights"}).json() == {"results": [None]}
    s.wait_text("RotaryEmbedding: Failed to load weights")
    s.wait_text("Reloading and processing weights took")
    assert http(s.port, "/is_sleeping").json() == {"is_sleeping": True}, "the KV cache still sleeps"
    assert http(s.port, "/wake_up?tags=kv_cache", {}).status == 200
    assert http(s.port, "/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_gauge(s.port) == "awake"
    assert read_meminfo(meminfo).available == awake, "the wake takes the same memory back"
    assert complete(s.port) == before


def test_a_plain_wake_from_level_2_without_reload_answers_200_with_empty_text(sim: StartSim) -> None:
    s = sim("m", "--enable-sleep-mode", env=DEV)
    s.wait_ready()
    assert complete(s.port) != ""
    assert http(s.port, "/sleep?level=2", {}).status == 200
    assert http(s.port, "/wake_up", {}).status == 200
    s.wait_text("wake up the engine with tags: None")
    assert complete(s.port) == "", "silent garbage: the weights were never reloaded"


def test_a_request_sent_while_asleep_is_held_until_the_wake(sim: StartSim) -> None:
    s = sim("m", "--enable-sleep-mode", env=DEV)
    s.wait_ready()
    assert http(s.port, "/sleep?level=2", {}).status == 200
    answers: list[str] = []
    held = threading.Thread(target=lambda: answers.append(complete(s.port)))
    held.start()
    held.join(1.0)
    assert held.is_alive(), "no answer while asleep"
    assert http(s.port, "/wake_up?tags=weights", {}).status == 200
    assert http(s.port, "/collective_rpc", {"method": "reload_weights"}).status == 200
    assert http(s.port, "/wake_up?tags=kv_cache", {}).status == 200
    held.join(30)
    assert answers and answers[0] != ""


def test_level_1_keeps_a_host_copy_of_the_weights_that_the_wake_does_not_give_back(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    s = sim("m", "--enable-sleep-mode", "--gpu-memory-utilization", "0.5", env={**DEV, "GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_ready()
    awake = read_meminfo(meminfo).available
    assert http(s.port, "/sleep", {}).status == 200, "level 1 is the default"
    assert sleep_gauge(s.port) == "weights_offloaded"
    s.wait_text("GiB is backed up in CPU")
    assert http(s.port, "/wake_up", {}).status == 200
    assert complete(s.port) != "", "level 1 wakes with its weights"
    assert awake - read_meminfo(meminfo).available > 27 * GIB, "on unified memory the host copy is a second copy of the weights"


def test_a_wake_whose_memory_another_process_took_kills_the_engine(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    s = sim("m", "--enable-sleep-mode", "--gpu-memory-utilization", "0.5", env={**DEV, "GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_ready()
    assert http(s.port, "/sleep?level=2", {}).status == 200
    adjust(meminfo, -int(read_meminfo(meminfo).available - 2 * GIB) // 1024 * 1024)
    reply: Reply = http(s.port, "/wake_up?tags=weights", {})
    assert reply.status == 500
    s.wait_text("EngineCore encountered a fatal error.", stream="stdout")
    s.wait_text("torch.OutOfMemoryError")
    assert http(s.port, "/health").status == 503


def test_a_body_sent_to_a_development_route_is_read_so_the_next_request_on_the_connection_is_answered(sim: StartSim) -> None:
    s = sim("m", "--enable-sleep-mode", env=DEV)
    s.wait_ready()
    completion = json.dumps({"model": "m", "prompt": "Say something", "max_tokens": 4}).encode()
    connection = HTTPConnection("127.0.0.1", s.port, timeout=30)
    try:
        for method, path, body, chunked in (
            ("POST", "/wake_up", b'{"tags": ["weights"], "note": "a body vLLM does not read"}', False),
            ("POST", "/reset_prefix_cache", b'{"reset_running_requests": false}', False),
            ("POST", "/wake_up", b'{"chunked": true}', True),
            ("GET", "/is_sleeping", b"{}", False),
        ):
            headers = {"content-type": "application/json"}
            connection.request(method, path, body=iter([body]) if chunked else body, headers=headers, encode_chunked=chunked)
            first = connection.getresponse()
            first.read()
            assert first.status == 200, (path, first.status)
            connection.request("POST", "/v1/completions", body=completion, headers=headers)  # the same connection, kept alive
            second = connection.getresponse()
            assert second.status == 200, (path, second.status, second.read())
            assert json.loads(second.read())["choices"][0]["text"], path
    finally:
        connection.close()
