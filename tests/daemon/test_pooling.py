"""Embedding and other pooling models: warmed up and probed on a route they serve, chosen from `Supported tasks`.

vLLM opens only the routes of the model's tasks, so an embedding model answers
404 to /v1/completions. The table tests cover the parser and the choice; the
others run `gb10d run` against gb10d.sim serving Qwen/Qwen3-Embedding-8B,
sized as the real checkpoint, at the share the README gives it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gb10d.base.configload import load_config
from gb10d.base.errors import ConfigError
from gb10d.base.tasks import COMPLETIONS, Probe, choose
from gb10d.daemon.probe import OWN_QUERY
from gb10d.vllm.events import TasksSupported
from gb10d.vllm.logparse import parse_line
from harness import Daemon, NotifySocket, Setup, wait_until

EMBEDDING_MODEL = "Qwen/Qwen3-Embedding-8B"


@pytest.mark.parametrize(
    ("line", "tasks"),
    [
        # 0.23-0.30: the stream wrapper's tag; multiprocessing engine (the default): msgpack hands a list over.
        ("(APIServer pid=4242) INFO 12-02 14:11:07 [api_server.py:579] Supported tasks: ['generate']", ("generate",)),
        ("(APIServer pid=4242) INFO 12-02 14:11:07 [api_server.py:579] Supported tasks: ['embed', 'token_embed']", ("embed", "token_embed")),
        # A set's order: the pooler's tasks come either way round.
        ("(APIServer pid=4242) INFO 12-02 14:11:07 [api_server.py:579] Supported tasks: ['token_classify', 'classify']", ("token_classify", "classify")),
        # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine's own tuple.
        ("INFO 12-02 14:11:07 [api_server.py:579] Supported tasks: ('generate',)", ("generate",)),
        ("INFO 12-02 14:11:07 [api_server.py:579] Supported tasks: ('embed&token_classify',)", ("embed&token_classify",)),
        # 0.34: the API server's entry point moved.
        ("(APIServer pid=7) INFO 12-02 14:11:07 [entry.py:135] Supported tasks: ['transcription']", ("transcription",)),
        # The old source form.
        ("INFO 12-02 14:11:07 api_server.py:579] Supported tasks: ['generate']", ("generate",)),
    ],
)
def test_supported_tasks_line_is_parsed_in_each_known_format(line: str, tasks: tuple[str, ...]) -> None:
    assert TasksSupported(tasks) in parse_line(line)


@pytest.mark.parametrize(
    "message",
    [
        # A line cut by a terminal at 80 columns names no task: nothing is concluded from it.
        "Supported tasks: ['",
        # A pooling request's error names the tasks mid-message; it is no announcement.
        "Task embed is not supported, it must be one of the supported tasks. Supported tasks: ('classify',)",
    ],
)
def test_supported_tasks_are_only_taken_from_the_announcement(message: str) -> None:
    assert not any(isinstance(e, TasksSupported) for e in parse_line(f"INFO 12-02 14:11:07 [api_server.py:579] {message}"))


@pytest.mark.parametrize(
    ("setting", "tasks", "probe"),
    [
        ("auto", ("generate",), Probe(COMPLETIONS)),
        ("auto", None, Probe(COMPLETIONS)),  # no `Supported tasks` line seen: as before
        ("auto", ("token_embed", "embed"), Probe("/v1/embeddings")),
        ("auto", ("embed&token_classify",), Probe("/v1/embeddings")),
        ("auto", ("classify", "token_classify"), Probe("/classify")),
        ("auto", ("token_embed",), Probe("/pooling", "token_embed")),
        ("auto", ("token_classify",), Probe("/pooling", "token_classify")),
        ("auto", ("generate", "transcription"), Probe(COMPLETIONS)),
        ("auto", ("transcription",), Probe(None)),
        ("auto", ("plugin",), Probe(None)),
        ("/v1/embeddings", ("generate",), Probe("/v1/embeddings")),
        ("/pooling", ("embed",), Probe("/pooling")),
        ("none", ("generate",), Probe(None)),
    ],
)
def test_probe_follows_the_tasks_unless_the_config_names_a_route(setting: str, tasks: tuple[str, ...] | None, probe: Probe) -> None:
    assert choose(setting, tasks) == probe


def test_probe_bodies_ask_for_one_token_or_one_pooled_word() -> None:
    assert Probe(COMPLETIONS).body("m") == {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    assert Probe("/v1/embeddings").body("m") == {"model": "m", "input": "Hi"}
    assert Probe("/pooling", "token_embed").body("m") == {"model": "m", "input": "Hi", "task": "token_embed"}


def test_a_probe_route_vllm_does_not_serve_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "gb10d.toml"
    path.write_text('[vllm]\nmodel = "m"\nexecutable = "/bin/true"\n\n[liveness]\nprobe_route = "/v1/embedding"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    text = str(raised.value)
    assert f"{path}:6: liveness.probe_route: must be one of 'auto', '/v1/completions', '/v1/embeddings'" in text
    assert "got '/v1/embedding'" in text


# --- against gb10d.sim ------------------------------------------------------------------------------------------

# The README's share for the embedding model (0.2 of 121.69 GiB): 14.1 GiB of weights and its full 40960 tokens of KV.
README_SHARE = 0.2
IDLE = {"liveness.health_interval_s": 0.2, "liveness.idle_probe_interval_s": 0.5, "liveness.probe_timeout_s": 5.0}


def _embedding_setup(tmp_path: Path, extra: dict[str, object] | None = None, scenario: str = "healthy") -> Setup:
    return Setup(
        tmp_path,
        scenario=scenario,
        utilization=README_SHARE,
        extra={"vllm.model": EMBEDDING_MODEL, "vllm.args": {}, **IDLE, **(extra or {})},
    )


def _access(daemon: Daemon, route: str) -> list[str]:
    """vLLM's access-log lines (forwarded to the journal) for POSTs to `route`, gb10d's own (`?gb10d=probe`) included."""
    return [line for line in daemon.lines if f'"POST {route} HTTP/1.1"' in line or f'"POST {route}?{OWN_QUERY} HTTP/1.1"' in line]


def _ready(notify: NotifySocket) -> None:
    notify.wait_for(lambda m: m.get("READY") == "1", 90.0)


@pytest.mark.slow
def test_embedding_model_is_ready_after_an_embedding_warm_up_and_stays_alive_while_idle(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    daemon = Daemon(_embedding_setup(tmp_path), notify)
    daemons.append(daemon)
    _ready(notify)
    assert "Supported tasks: ['embed', 'token_embed']" in "\n".join(daemon.lines)
    daemon.wait_line(r"gb10d: vLLM is ready after .*/v1/models lists tiny, warm-up embedding took")
    # Idle: the probe embeds a word every 0.5 s and each one answers; nothing is found hung or restarted.
    wait_until(lambda: len([line for line in _access(daemon, "/v1/embeddings") if " 200 OK" in line]) >= 4, 60, "idle embedding probes answered")
    assert not _access(daemon, "/v1/completions")
    assert not any(re.search(r"gb10d: vLLM's engine is (hung|dead)", line) for line in daemon.lines)
    assert notify.count("READY", "1") == 1
    assert daemon.stop() == 0


@pytest.mark.slow
def test_hung_embedding_model_is_found_by_its_idle_embedding_probe(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = _embedding_setup(tmp_path, {"liveness.probe_timeout_s": 2.0, "liveness.progress_timeout_s": 3.0, "restart.max_attempts": 5}, "hang_after=300")
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    _ready(notify)
    line = daemon.wait_line(r"gb10d: vLLM's engine is hung: .*; stopping its process group")
    assert "the idle probe (a one-word embedding) sent" in line.string
    daemon.stop()


@pytest.mark.slow
def test_probe_route_in_the_config_overrides_the_tasks(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # --convert classify: the model's tasks say /classify; the operator's route is the one used.
    extra = {"liveness.probe_route": "/pooling", "vllm.args": {"convert": "classify"}}
    daemon = Daemon(_embedding_setup(tmp_path, extra), notify)
    daemons.append(daemon)
    _ready(notify)
    daemon.wait_line(r"gb10d: vLLM is ready after .*warm-up pooling request took")
    wait_until(lambda: len(_access(daemon, "/pooling")) >= 3, 60, "idle probes on /pooling")
    assert not _access(daemon, "/classify") and not _access(daemon, "/v1/completions")
    assert daemon.stop() == 0


@pytest.mark.slow
def test_a_probe_route_the_model_does_not_serve_fails_the_warm_up_with_the_key_to_set(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    daemon = Daemon(_embedding_setup(tmp_path, {"liveness.probe_route": "/v1/completions", "restart.max_attempts": 1}), notify)
    daemons.append(daemon)
    line = daemon.wait_line(r"gb10d: the warm-up completion \(/v1/completions\) failed \(404\)")
    assert "set liveness.probe_route to one it serves" in line.string
    assert notify.count("READY", "1") == 0
    daemon.wait_exit()


@pytest.mark.slow
def test_generate_model_is_still_warmed_up_and_probed_with_a_completion(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    daemon = Daemon(Setup(tmp_path, extra=IDLE), notify)
    daemons.append(daemon)
    _ready(notify)
    assert "Supported tasks: ['generate']" in "\n".join(daemon.lines)
    daemon.wait_line(r"gb10d: vLLM is ready after .*warm-up completion took")
    wait_until(lambda: len(_access(daemon, "/v1/completions")) >= 3, 60, "idle completion probes")
    assert not _access(daemon, "/v1/embeddings")
    assert daemon.stop() == 0
