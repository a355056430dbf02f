"""gb10d-front.socket before gb10d-front.service under a real systemd (Debian 12): what the operator's commands do.

systemd holds the public port (8000), so a `systemctl restart gb10d-front`
refuses no client: connections made while no front runs wait in the
socket's queue, and the stopping front finishes what it has accepted. A
`systemctl reload gb10d-front` after an instance config is added serves its
model with the same front process. The instances are gb10d.sim behind
gb10d@NAME, from the package as installed by dpkg.

A client inside the container opens a new connection every 50 ms, each
request in a thread of its own, so that requests arrive while one front
stops and the next starts, and writes one JSON line per answer.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from systemd_harness import CONTAINER_PATH, MACHINES, Container, Debian
from test_systemd_e2e import SIM, SIM_SCRIPT, set_memory, sim_config

pytestmark = [pytest.mark.systemd, pytest.mark.slow, pytest.mark.timeout(900)]

FRONT = "gb10d-front.service"
SOCKET = "gb10d-front.socket"
URL = "http://127.0.0.1:8000/v1/completions"
CLIENT_OUT = "/tmp/front-client.jsonl"
CLIENT_STOP = "/tmp/front-client.stop"
INSTANCES = {"alpha": 8101, "beta": 8102}

# One request every 50 ms, each on a new connection and in a thread of its own; one line per answer or error.
CLIENT = """
import json, os, sys, threading, time, urllib.error, urllib.request

url, model, out, stop = sys.argv[1:5]
body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
lock = threading.Lock()
started = time.monotonic()


def one(sent_s):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            outcome = str(response.status)
    except urllib.error.HTTPError as error:
        outcome = f"{error.code}: {error.read()[:200]!r}"
    except Exception as error:  # refused, reset, closed without an answer, timed out: what the test counts
        outcome = f"{type(error).__name__}: {error}"
    line = json.dumps({"sent_s": round(sent_s, 3), "took_s": round(time.monotonic() - started - sent_s, 3), "outcome": outcome})
    with lock, open(out, "a") as file:
        file.write(line + "\\n")


threads = []
while not os.path.exists(stop):
    thread = threading.Thread(target=one, args=(time.monotonic() - started,))
    thread.start()
    threads.append(thread)
    # The client's own pace (a request every 50 ms), not a wait for anything.
    time.sleep(max(0.0, started + len(threads) * 0.05 - time.monotonic()))
for thread in threads:
    thread.join()
"""

# One request, its status or the error, for the checks between the client's runs.
ONE_REQUEST = """
import json, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1], data=json.dumps({"model": sys.argv[2], "prompt": "Hello", "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=float(sys.argv[3])) as response:
        print(response.status, json.loads(response.read())["model"])
except urllib.error.HTTPError as error:
    print(error.code, error.read()[:200])
except Exception as error:
    print(0, type(error).__name__, error)
"""


def ask(box: Container, model: str, timeout_s: float = 10.0) -> str:
    """`STATUS MODEL` of one completion request through the front, or `0 ERROR` when none came."""
    return box.run("python3", "-c", ONE_REQUEST, URL, model, str(timeout_s), timeout=timeout_s + 30).stdout.strip()


def instance_config(name: str) -> str:
    """gb10d@NAME's config: the sim serving model NAME on its own internal port (a share of 0.3, so a short context), no metrics listener."""
    config = sim_config(utilization=0.3, port=INSTANCES[name], extra='\n[vllm.args]\nmax_model_len = 4096\n\n[metrics]\nlisten = ""\n')
    return config.replace('served_model_name = "qwen-test"', f'served_model_name = "{name}"')


@pytest.fixture(scope="module")
def installed(container: Container, debian: Debian, build_deb: Callable[[str, str], Path]) -> Container:
    """The container with its architecture's .deb installed by dpkg and the sim in place."""
    container.run("dpkg", "-i", container.put(build_deb(debian.arch, debian.python), "gb10d.deb"))
    container.write(SIM, SIM_SCRIPT, mode="0755")
    set_memory(container, total_gib=121.69, free_gib=115.0)
    return container


@pytest.fixture(scope="module")
def front(installed: Container) -> Iterator[Container]:
    """gb10d@alpha serving and the front started through its socket, with the front's defaults (port 8000 from the socket)."""
    box = installed
    box.write("/etc/gb10d.toml", "[front]\nhold_timeout_s = 120.0\n")
    box.write("/etc/gb10d/alpha.toml", instance_config("alpha"))
    try:
        box.run("systemctl", "start", "gb10d@alpha.service", timeout=300)
        box.run("systemctl", "start", FRONT)
        yield box
    finally:
        box.run("systemctl", "stop", SOCKET, FRONT, "gb10d@alpha.service", "gb10d@beta.service", check=False)
        box.run("systemctl", "reset-failed", SOCKET, FRONT, "gb10d@alpha.service", "gb10d@beta.service", check=False)


def test_the_vendored_aiohttp_parses_with_its_c_parser_on_the_system_python(installed: Container, debian: Debian) -> None:
    script = (
        "import sys\n"
        "sys.path.insert(0, '/usr/lib/gb10d/site-packages')\n"
        "import aiohttp.web\n"
        "from aiohttp import _http_parser, http_parser\n"
        "print(http_parser.HttpRequestParser is _http_parser.HttpRequestParser, _http_parser.__file__)\n"
    )
    c_parser, path = installed.run("python3", "-I", "-c", script).stdout.split()
    assert c_parser == "True", "aiohttp fell back to its parser in Python"
    assert path.endswith(f".cpython-{debian.python.replace('.', '')}-{MACHINES[debian.arch]}-linux-gnu.so"), path


def test_the_front_units_are_installed_disabled_and_verify(installed: Container) -> None:
    for unit in (SOCKET, FRONT):
        assert installed.show(unit, "ActiveState", "UnitFileState") == {"ActiveState": "inactive", "UnitFileState": "disabled"}, unit
    verify = installed.run("systemd-analyze", "verify", SOCKET, FRONT, check=False)
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stdout + verify.stderr
    shown = installed.show(SOCKET, "Listen", "Backlog", "FileDescriptorName")
    assert shown == {"Listen": "[::]:8000 (Stream)", "Backlog": "4096", "FileDescriptorName": "front"}, shown


def test_restarting_the_front_twice_refuses_no_request_and_answers_all(front: Container) -> None:
    assert front.show(SOCKET, "ActiveState") == {"ActiveState": "active"}, "starting the front must start its socket"
    first = ask(front, "alpha", timeout_s=60)
    assert first == "200 alpha", f"the front must serve the socket systemd passed it (fd 3, LISTEN_FDS): {first}"
    front.run("rm", "-f", CLIENT_OUT, CLIENT_STOP)
    argv = ["nsenter", "-t", str(front.init_pid), "-a", "env", "-i", f"PATH={CONTAINER_PATH}", "python3", "-c", CLIENT, URL, "alpha", CLIENT_OUT, CLIENT_STOP]
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = [front.show(FRONT, "MainPID")["MainPID"]]
    try:
        def answered() -> int:
            return len(front.run("cat", CLIENT_OUT, check=False).stdout.splitlines())

        front.wait_for("20 answers before the first restart", lambda: answered() >= 20)
        for restart in (1, 2):
            front.run("systemctl", "restart", "gb10d-front")
            pids.append(front.show(FRONT, "MainPID")["MainPID"])
            before = answered()
            front.wait_for(f"20 answers after restart {restart}", lambda before=before: answered() >= before + 20)
        front.run("touch", CLIENT_STOP)
        output, _ = client.communicate(timeout=120)
    finally:
        client.kill()
        client.wait()
    assert client.returncode == 0, output
    assert len(set(pids)) == 3, f"two restarts, three fronts: {pids}"
    answers = [json.loads(line) for line in front.read(CLIENT_OUT).splitlines()]
    failed = [answer for answer in answers if answer["outcome"] != "200"]
    assert failed == [], f"{len(failed)} of {len(answers)} requests got no 200 across two restarts: {failed[:10]}"
    assert len(answers) >= 60
    state = front.show(FRONT, "ActiveState", "NRestarts")
    assert state == {"ActiveState": "active", "NRestarts": "0"}, state


def test_reload_serves_a_newly_added_instance_without_restarting_the_front(front: Container) -> None:
    before = front.show(FRONT, "MainPID")["MainPID"]
    front.write("/etc/gb10d/beta.toml", instance_config("beta"))
    front.run("systemctl", "start", "gb10d@beta.service", timeout=300)
    front.run("systemctl", "reload", "gb10d-front")
    # ExecReload returns once SIGHUP is sent; the front reads the configs after.
    front.wait_for("the front to serve beta", lambda: ask(front, "beta") == "200 beta")
    assert ask(front, "alpha") == "200 alpha"
    state = front.show(FRONT, "ActiveState", "MainPID", "NRestarts")
    assert state == {"ActiveState": "active", "MainPID": before, "NRestarts": "0"}, state
