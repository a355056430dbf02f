"""What an operator sees with the .deb under a real systemd, on two systems.

- Debian 12 on amd64 (systemd 252, Python 3.11): the amd64 package.
- Debian 13 on arm64 (systemd 257, Python 3.13), emulated by qemu-user on an
  x86_64 machine: the arm64 package GB10 owners install, built by the same
  scripts with the wheels for Python 3.13. Its aarch64 extension module, its
  launcher, maintainer scripts and units run there as they would on arm64.

One container boots per system; the tests run in file order because the last
ones upgrade, remove and purge the package. vLLM is gb10d.sim, shipped inside
the package, started through /opt/sim/bin/vllm, with a fixed meminfo file that
both gb10d and the sim read, so the memory figures do not depend on what else
this machine is doing.
"""

from __future__ import annotations

import glob
import json
import os
import re
import selectors
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gb10d.daemon.lab import meminfo_text
from gb10d.machine.journal import MESSAGE_IDS
from gb10d.machine.kernellog import source_argv
from systemd_harness import DEBIAN_12_AMD64, DEBIAN_13_ARM64, MACHINES, Container, Debian, gb10d_version

pytestmark = [pytest.mark.systemd, pytest.mark.slow, pytest.mark.timeout(900)]

UNIT = "gb10d.service"
INSTANCE = "gb10d@second.service"
SIM = "/opt/sim/bin/vllm"
# The simulated /proc/meminfo, in which each stand-in also holds its own memory: the units write it, whichever
# user they run as; ProtectSystem=strict leaves /dev writable.
MEMINFO = "/dev/shm/gb10d-sim/meminfo"
GIB_KB = 1024 * 1024

# The sim runs from the package's own tree with the system python3, the way
# /usr/bin/gb10d runs gb10d.
SIM_SCRIPT = """#!/usr/bin/python3 -I
import runpy
import sys

sys.path.insert(0, "/usr/lib/gb10d/site-packages")
runpy.run_module("gb10d.sim", run_name="__main__", alter_sys=True)
"""


def meminfo(total_gib: float, free_gib: float) -> str:
    """A /proc/meminfo-format text with the given totals (the page cache makes up the difference)."""
    return meminfo_text(total_gib, free_gib, cached_gib=total_gib - free_gib - 2)


def set_memory(box: Container, total_gib: float, free_gib: float) -> None:
    """The simulated machine's memory figures, set while no stand-in holds any of it."""
    box.write(MEMINFO, meminfo(total_gib, free_gib))
    box.run("chmod", "0777", str(Path(MEMINFO).parent))


def sim_config(
    scenario: str = "healthy",
    utilization: float = 0.8,
    port: int = 8000,
    extra_env: str = "",
    extra: str = "",
    preflight: bool = False,
    speed: float = 0.01,
) -> str:
    """A gb10d.toml that runs the sim at `speed` times real time; `extra_env` adds to [vllm.env], `extra` appends tables."""
    return f"""
[vllm]
executable = "{SIM}"
model = "Qwen/Qwen3.6-27B-FP8"
served_model_name = "qwen-test"
host = "127.0.0.1"
port = {port}
gpu_memory_utilization = {utilization}

[vllm.env]
GB10D_SIM_SPEED = "{speed}"
GB10D_SIM_SCENARIO = "{scenario}"
GB10D_SIM_MEMINFO = "{MEMINFO}"
{extra_env}
[memory]
meminfo_path = "{MEMINFO}"
# The tests want vLLM's own free-memory failure and gb10d's recovery from it,
# not gb10d lowering the utilization before the first start (unless asked).
preflight = {str(preflight).lower()}
{extra}"""


def unit_processes(box: Container) -> list[str]:
    """`pid comm` of every process of the gb10d user in the container: what the units run."""
    script = (
        "import os, pwd\n"
        "uid = pwd.getpwnam('gb10d').pw_uid\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        if os.stat(f'/proc/{p}').st_uid == uid:\n"
        "            print(p, open(f'/proc/{p}/comm').read().strip())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    return box.run("python3", "-c", script).stdout.splitlines()


def http_get(box: Container, url: str) -> tuple[int, str]:
    """Status and body of a GET from inside the container (its loopback is its own)."""
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        "    r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
        "    print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code)\n"
    )
    out = box.run("python3", "-c", script, url).stdout
    status, _, body = out.partition("\n")
    return int(status), body


def journal(box: Container, unit: str, *options: str) -> str:
    """The unit's journal in `cat` format (messages only)."""
    return box.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, *options).stdout


@contextmanager
def drop_in(box: Container, unit: str, text: str) -> Iterator[None]:
    """A unit drop-in for the duration of a block, as an admin would add with systemctl edit."""
    path = f"/etc/systemd/system/{unit}.d/test.conf"
    box.write(path, text)
    box.run("systemctl", "daemon-reload")
    try:
        yield
    finally:
        box.run("rm", "-f", path)
        box.run("systemctl", "daemon-reload")


@pytest.fixture(scope="module", params=[DEBIAN_12_AMD64, DEBIAN_13_ARM64], ids=lambda debian: debian.name)
def debian(request: pytest.FixtureRequest) -> Debian:
    """Each system the module's tests run on, one container after the other."""
    result: Debian = request.param
    return result


# Each emulated start of gb10d takes 15 to 40 s, so under emulation only the
# tests marked with this run: the subset that proves the arm64 package (install,
# its extension module, the units, a config error, start to READY, STATUS=
# phases, reload, stop, a free-memory recovery, purge). The others check what
# the architecture does not change. On an arm64 machine every test runs.
emulated_too = pytest.mark.emulated_too


@pytest.fixture(autouse=True)
def _only_the_subset_under_emulation(request: pytest.FixtureRequest, debian: Debian) -> None:
    if debian.emulated() and request.node.get_closest_marker("emulated_too") is None:
        pytest.skip(f"{debian.name} runs under emulation, where only the tests marked emulated_too run")


@pytest.fixture(scope="module")
def installed(container: Container, debian: Debian, build_deb: Callable[[str, str], Path]) -> Container:
    """The container with its architecture's .deb, built for its python3, installed by dpkg and the sim in place.

    dpkg's output is kept in the share as dpkg-install.log for the install test.
    """
    deb = container.put(build_deb(debian.arch, debian.python), "gb10d.deb")
    result = container.run("dpkg", "-i", deb)
    (container.share / "dpkg-install.log").write_text(result.stdout + result.stderr)
    container.write(SIM, SIM_SCRIPT, mode="0755")
    set_memory(container, total_gib=121.69, free_gib=115.0)
    return container


@pytest.fixture
def supervisor(installed: Container) -> Iterator[Container]:
    """The installed container for a test that runs `gb10d run`; units are stopped and reset afterwards."""
    yield installed
    installed.run("systemctl", "stop", UNIT, INSTANCE, check=False)
    installed.run("systemctl", "reset-failed", UNIT, INSTANCE, check=False)


@emulated_too
def test_install_creates_the_user_compiles_and_starts_nothing(installed: Container) -> None:
    output = (installed.share / "dpkg-install.log").read_text()
    assert "systemctl start gb10d" in output, output
    passwd = installed.run("getent", "passwd", "gb10d").stdout.strip().split(":")
    assert passwd[5] == "/var/lib/gb10d" and int(passwd[2]) < 1000, passwd
    assert installed.run("gb10d", "--version").stdout.strip() == f"gb10d {gb10d_version()}"
    # postinst compiled the tree for the system python3, so starts do not recompile.
    assert installed.exists("/usr/lib/gb10d/site-packages/gb10d/__pycache__")
    assert installed.show(UNIT, "ActiveState", "UnitFileState") == {"ActiveState": "inactive", "UnitFileState": "disabled"}


@emulated_too
def test_the_vendored_extension_module_is_the_one_for_this_cpu_and_python(installed: Container, debian: Debian) -> None:
    # pydantic-core is the only compiled part of the package: a wrong or missing
    # one fails every gb10d command at import, before anything can be logged.
    assert installed.run("uname", "-m").stdout.strip() == MACHINES[debian.arch]
    script = (
        "import sys\n"
        "sys.path.insert(0, '/usr/lib/gb10d/site-packages')\n"
        "from pydantic_core import _pydantic_core\n"
        "print(_pydantic_core.__file__)\n"
    )
    loaded = installed.run("python3", "-I", "-c", script).stdout.strip()
    suffix = f".cpython-{debian.python.replace('.', '')}-{MACHINES[debian.arch]}-linux-gnu.so"
    assert loaded.startswith("/usr/lib/gb10d/site-packages/pydantic_core/") and loaded.endswith(suffix), loaded
    installed.write("/tmp/gb10d-check.toml", sim_config())
    check = installed.run("gb10d", "check-config", "--config", "/tmp/gb10d-check.toml", check=False)
    assert check.returncode == 0 and "Traceback" not in check.stderr, check.stdout + check.stderr


def _journal_files_open(pid: int) -> bool:
    """Whether a process has opened a journal file (journalctl has then fixed where it starts)."""
    try:
        return any(os.readlink(fd).endswith(".journal") for fd in glob.glob(f"/proc/{pid}/fd/*"))
    except OSError:
        return False


@emulated_too
def test_the_kernel_followers_query_shows_the_first_line_logged_after_it_starts(container: Container) -> None:
    # gb10d follows the kernel's messages with journalctl, a match (--dmesg) and
    # --follow. systemd 252's journalctl drops the first matching entry after the
    # position it starts from when that position is the tail (--lines=0): the
    # first driver line would go unseen. The same query, matching a tag instead
    # of the kernel transport, must show the very first line.
    tag = "gb10d-follow-check"
    argv = source_argv("journal")
    assert argv is not None and "--dmesg" in argv
    query = [f"SYSLOG_IDENTIFIER={tag}" if arg == "--dmesg" else arg for arg in argv]
    follower = subprocess.Popen(["nsenter", "-t", str(container.init_pid), "-a", *query], stdout=subprocess.PIPE)
    try:
        def journalctl() -> int | None:
            children = Path(f"/proc/{follower.pid}/task/{follower.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            return int(pids[0]) if pids else None

        container.wait_for("journalctl to open the journal", lambda: (pid := journalctl()) is not None and _journal_files_open(pid))
        container.run("logger", "-t", tag, "first")
        container.run("logger", "-t", tag, "second")
        assert follower.stdout is not None
        shown = b""
        with selectors.DefaultSelector() as selector:
            selector.register(follower.stdout, selectors.EVENT_READ)
            while shown.count(b"\n") < 2 and selector.select(timeout=30):
                shown += os.read(follower.stdout.fileno(), 4096)
        assert shown.decode().splitlines() == ["first", "second"], shown
    finally:
        follower.kill()
        follower.wait()


def test_starting_the_unedited_config_fails_once_and_names_what_to_edit(supervisor: Container) -> None:
    # The shipped /etc/gb10d.toml points at a vLLM venv this machine does not have.
    assert supervisor.run("systemctl", "start", UNIT, check=False).returncode != 0
    state = supervisor.show(UNIT, "ActiveState", "ExecMainStatus", "NRestarts")
    assert state == {"ActiveState": "failed", "ExecMainStatus": "78", "NRestarts": "0"}, state
    errors = journal(supervisor, UNIT, "-p", "err")
    assert "/opt/vllm-env/bin/vllm" in errors and "vllm.venv" in errors, errors
    # The checker before it points at the line to edit.
    assert re.search(r"/etc/gb10d.toml:\d+: vllm.venv", journal(supervisor, UNIT)), journal(supervisor, UNIT)


@emulated_too
def test_units_pass_systemd_analyze_verify(installed: Container, debian: Debian) -> None:
    # Documentation=man:gb10d(8) is checked with man where the root has man-db
    # (Debian 12; under emulation its triggers would slow every dpkg run).
    man = [] if "man-db" in debian.packages else ["--man=no"]
    result = installed.run("systemd-analyze", "verify", *man, UNIT, INSTANCE, check=False)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


@emulated_too
def test_catalog_explains_gb10d_messages(installed: Container) -> None:
    catalog = installed.run("journalctl", "--list-catalog").stdout
    assert "gb10d" in catalog, "the dpkg trigger did not index /usr/lib/systemd/catalog/gb10d.catalog"


@emulated_too
def test_config_error_fails_the_start_with_78_and_is_not_restarted(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config().replace("port = 8000", 'port = "eighty"'))
    start = supervisor.run("systemctl", "start", UNIT, check=False)
    assert start.returncode != 0
    state = supervisor.show(UNIT, "ActiveState", "SubState", "ExecMainStatus", "NRestarts")
    # auto-restart would show as activating/auto-restart here.
    assert state == {"ActiveState": "failed", "SubState": "failed", "ExecMainStatus": "78", "NRestarts": "0"}, state
    log = journal(supervisor, UNIT)
    assert "/etc/gb10d.toml:" in log and "vllm.port" in log, log
    assert "Traceback" not in log, log


@emulated_too
def test_start_returns_only_once_vllm_serves(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config())
    supervisor.run("systemctl", "start", UNIT)
    state = supervisor.show(UNIT, "ActiveState", "SubState", "StatusText")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running"), state
    assert state["StatusText"].startswith("serving"), state
    assert http_get(supervisor, "http://127.0.0.1:8000/health")[0] == 200
    models = json.loads(http_get(supervisor, "http://127.0.0.1:8000/v1/models")[1])
    assert [card["id"] for card in models["data"]] == ["qwen-test"]
    status = supervisor.run("gb10d", "status", check=False)
    assert status.returncode == 0 and "qwen-test" in status.stdout + status.stderr, status.stdout + status.stderr


@emulated_too
def test_reload_keeps_the_same_vllm_serving(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config())
    supervisor.run("systemctl", "start", UNIT)
    before = supervisor.show(UNIT, "MainPID")
    processes_before = unit_processes(supervisor)
    mark = supervisor.journal_mark()
    supervisor.run("systemctl", "reload", UNIT)

    def gb10d_applied_the_reload() -> bool:
        # ExecReload returns once SIGHUP is sent; gb10d's own entry says the reload was handled.
        return bool(supervisor.entries(UNIT, mark, _PID=before["MainPID"], MESSAGE_ID=MESSAGE_IDS["reload_applied"]))

    supervisor.wait_for("gb10d to log the reload", gb10d_applied_the_reload)
    state = supervisor.show(UNIT, "ActiveState", "MainPID", "StatusText")
    assert (state["ActiveState"], state["MainPID"]) == ("active", before["MainPID"]) and state["StatusText"].startswith("serving"), state
    assert unit_processes(supervisor) == processes_before, "an unchanged config must not restart vLLM"


@emulated_too
def test_stop_leaves_no_process_of_the_unit(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config())
    supervisor.run("systemctl", "start", UNIT)
    running = unit_processes(supervisor)
    assert len(running) >= 3, f"expected gb10d, the API server and its EngineCore, got {running}"
    supervisor.run("systemctl", "stop", UNIT)
    assert supervisor.show(UNIT, "ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}
    assert unit_processes(supervisor) == []


@emulated_too
def test_slow_start_shows_its_phases_and_outlasts_a_short_start_timeout(supervisor: Container, debian: Debian) -> None:
    # 8 shards, 150 simulated seconds each at speed 0.01: 12 s of loading,
    # longer than the 8 s start timeout, which only progress can extend. Under
    # emulation gb10d itself needs seconds before its first progress report, so
    # the timeout and the loading both stretch by the same factor.
    scale = debian.time_scale()
    config = sim_config(scenario="slow_shards=150", extra_env='GB10D_SIM_SHARDS = "8"\n', speed=0.01 * scale)
    supervisor.write("/etc/gb10d.toml", config)
    seen: list[str] = []

    def serving() -> bool:
        text = supervisor.show(UNIT, "StatusText")["StatusText"]
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        return text.startswith("serving")

    with drop_in(supervisor, UNIT, f"[Service]\nTimeoutStartSec={8 * scale:.0f}s\n"):
        supervisor.run("systemctl", "start", "--no-block", UNIT)
        supervisor.wait_for("StatusText serving", serving, timeout=120 * scale)
        state = supervisor.show(UNIT, "ActiveState", "NRestarts")
    assert state == {"ActiveState": "active", "NRestarts": "0"}, (state, seen)
    shards = [text for text in seen if re.match(r"loading weights \d+/8 ", text)]
    assert len(shards) >= 2, f"expected shard progress n/8 in StatusText, saw {seen}"
    assert seen[-1].startswith("serving") and seen.index(shards[-1]) < len(seen) - 1, seen


def test_watchdog_is_answered_while_serving(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config())
    with drop_in(supervisor, UNIT, "[Service]\nWatchdogSec=2s\n"):
        supervisor.run("systemctl", "start", UNIT)
        pings: set[str] = set()

        def pinged_three_times() -> bool:
            pings.add(supervisor.show(UNIT, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
            return len(pings - {"0"}) >= 3

        # Three pings span more than one 2 s period: a missing ping would have killed it.
        supervisor.wait_for("three watchdog pings", pinged_three_times, timeout=60)
        state = supervisor.show(UNIT, "ActiveState", "NRestarts")
    assert state == {"ActiveState": "active", "NRestarts": "0"}, state


@emulated_too
def test_free_memory_failure_recovers_and_the_warning_explains_it(supervisor: Container) -> None:
    # 0.9 of 121.69 GiB is 109.52 GiB, more than the 100 GiB free.
    set_memory(supervisor, total_gib=121.69, free_gib=100.0)
    supervisor.write("/etc/gb10d.toml", sim_config(utilization=0.9))
    try:
        supervisor.run("systemctl", "start", UNIT)
        state = supervisor.show(UNIT, "ActiveState", "StatusText", "NRestarts")
        assert state["ActiveState"] == "active" and state["StatusText"].startswith("serving"), state
        assert state["NRestarts"] == "0", "gb10d, not systemd, must recover"
        warnings = journal(supervisor, UNIT, "-p", "warning")
        assert "free memory" in warnings and "0.9" in warnings, warnings
        # journalctl -x adds the catalog's explanation to gb10d's own decisions.
        explained = supervisor.run("journalctl", "--no-pager", "-x", "-u", UNIT, "-p", "warning").stdout
        assert "Defined-By: gb10d" in explained, explained[-3000:]
    finally:
        supervisor.run("systemctl", "stop", UNIT)  # its stand-in gives its memory back first
        set_memory(supervisor, total_gib=121.69, free_gib=115.0)


def test_instance_serves_from_its_own_config_beside_the_main_unit(supervisor: Container) -> None:
    # Only its own port: the state file, learned file and metrics port are the instance's own by default.
    supervisor.write("/etc/gb10d.toml", sim_config(utilization=0.4))
    supervisor.write("/etc/gb10d/second.toml", sim_config(utilization=0.4, port=8001))
    supervisor.run("systemctl", "start", UNIT, INSTANCE)
    for unit in (UNIT, INSTANCE):
        assert supervisor.show(unit, "StatusText")["StatusText"].startswith("serving"), unit
    assert http_get(supervisor, "http://127.0.0.1:8001/health")[0] == 200
    status = supervisor.run("gb10d", "status", "--config", "/etc/gb10d/second.toml", check=False)
    assert status.returncode == 0 and "8001" in status.stdout, status.stdout + status.stderr
    supervisor.run("systemctl", "stop", UNIT)
    assert supervisor.show(INSTANCE, "ActiveState")["ActiveState"] == "active"
    assert supervisor.exists("/run/gb10d-second/state.json"), "stopping gb10d.service must not touch an instance's files"


def test_a_config_copied_from_the_main_one_is_refused_and_the_main_status_stays_right(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config(utilization=0.4))
    supervisor.run("systemctl", "start", UNIT)
    main_pid = supervisor.show(UNIT, "MainPID")["MainPID"]
    supervisor.write("/etc/gb10d/copy.toml", sim_config(utilization=0.4))
    try:
        checked = supervisor.run("gb10d", "check-config", "--config", "/etc/gb10d/copy.toml", check=False)
        assert checked.returncode == 78, checked.stdout + checked.stderr
        assert f"is held by the running instance gb10d (/etc/gb10d.toml, pid {main_pid})" in checked.stderr, checked.stderr
        start = supervisor.run("systemctl", "start", "gb10d@copy.service", check=False)
        assert start.returncode != 0
        assert supervisor.show("gb10d@copy.service", "ExecMainStatus")["ExecMainStatus"] == "78"
        log = journal(supervisor, "gb10d@copy.service")
        assert (f"vllm.port 127.0.0.1:8000 of gb10d@copy (/etc/gb10d/copy.toml) is held by the running instance gb10d "
                f"(/etc/gb10d.toml, pid {main_pid})") in log, log
        status = supervisor.run("gb10d", "status", check=False)
        assert status.returncode == 0 and status.stdout.startswith("gb10d is running: serving"), status.stdout + status.stderr
    finally:
        supervisor.run("systemctl", "reset-failed", "gb10d@copy.service", check=False)
        supervisor.run("rm", "-f", "/etc/gb10d/copy.toml")
        supervisor.run("systemctl", "stop", UNIT)


@emulated_too
def test_install_creates_the_memory_ledger_the_instances_share(installed: Container) -> None:
    listed = installed.run("stat", "-c", "%a %U %G", "/run/gb10d-ledger").stdout.split()
    assert listed == ["2775", "root", "gb10d"], listed


def test_two_instances_started_at_once_both_serve_without_a_memory_failure(supervisor: Container) -> None:
    # Two shares of 0.5 (2 x 61.85 GiB reserved) do not fit in 119.69 GiB available together: without the
    # ledger both would start on the same free memory and one would fail. With it, the one that asked second
    # waits for the first, then starts beside it with what is left.
    units = ("gb10d@one.service", "gb10d@two.service")
    set_memory(supervisor, total_gib=121.69, free_gib=115.0)
    for index, name in enumerate(("one", "two"), start=1):
        supervisor.write(
            f"/etc/gb10d/{name}.toml",
            sim_config(
                utilization=0.5,
                port=8000 + index,
                preflight=True,
                extra=f'\n[metrics]\nlisten = "127.0.0.1:{9400 + index}"\n\n[daemon]\n'
                f'state_file = "/run/gb10d-{name}/state.json"\nlearned_file = "/var/lib/gb10d/{name}/state.toml"\n',
            ),
        )
    try:
        supervisor.run("systemctl", "start", *units, timeout=300)  # one job each, run at the same time
        for unit in units:
            state = supervisor.show(unit, "ActiveState", "StatusText", "NRestarts")
            assert state["ActiveState"] == "active" and state["StatusText"].startswith("serving"), (unit, state)
            assert state["NRestarts"] == "0", (unit, state)
        logs = {unit: journal(supervisor, unit) for unit in units}
        for unit, log in logs.items():
            assert not re.search(r"Free memory on device|CUDA out of memory|gb10d: free memory .* is below", log), (unit, log[-3000:])
        waited = [unit for unit, log in logs.items() if "waiting until they serve or stop" in log]
        assert len(waited) == 1, logs
        first = next(u for u in units if u not in waited).removesuffix(".service")
        assert f"does not fit beside the starts of {first} (61.8" in logs[waited[0]], logs[waited[0]][-3000:]
        shown = supervisor.run("gb10d", "status", "--all", check=False)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        table = {line.split()[0]: line.split()[1] for line in shown.stdout.splitlines()[2:4]}
        assert table == {"gb10d@one": "serving", "gb10d@two": "serving"}, shown.stdout
    finally:
        supervisor.run("systemctl", "stop", *units, check=False)
        supervisor.run("systemctl", "reset-failed", *units, check=False)


def http_post(box: Container, url: str, body: dict[str, object], timeout_s: float = 120.0) -> tuple[int, str]:
    """Status and body of a JSON POST from inside the container; a request held by the front simply takes longer."""
    script = (
        "import json, sys, urllib.request, urllib.error\n"
        "request = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), headers={'Content-Type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.urlopen(request, timeout=float(sys.argv[3]))\n"
        "    print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
    )
    out = box.run("python3", "-c", script, url, json.dumps(body), str(timeout_s), timeout=timeout_s + 30).stdout
    status, _, text = out.partition("\n")
    return int(status), text


FRONT_MODELS = {"alpha": 8101, "beta": 8102}


def front_before_two_instances(box: Container, utilization: float, extra: str) -> list[str]:
    """/etc/gb10d.toml with only [front] (127.0.0.1:8000) and gb10d@alpha and @beta serving their own model with
    `extra` (their [on_demand]); returns the instance units. The front serves every /etc/gb10d/*.toml, so the earlier
    tests' instances (all serving qwen-test) go first."""
    set_memory(box, total_gib=121.69, free_gib=115.0)
    box.run("sh", "-c", "rm -f /etc/gb10d/*.toml")
    box.write("/etc/gb10d.toml", '[front]\nlisten = "127.0.0.1:8000"\nhold_timeout_s = 120.0\n')
    for name, port in FRONT_MODELS.items():
        config = sim_config(utilization=utilization, port=port, extra=f'{extra}\n[metrics]\nlisten = ""\n')
        box.write(f"/etc/gb10d/{name}.toml", config.replace('served_model_name = "qwen-test"', f'served_model_name = "{name}"'))
    return [f"gb10d@{name}.service" for name in FRONT_MODELS]


def test_the_front_swaps_two_on_demand_instances_and_systemctl_tells_the_story(supervisor: Container) -> None:
    # The front owns one address for both models; each gb10d@ instance parks its vLLM after a few idle seconds and
    # the front wakes it for the next request. What an operator sees is in systemctl and in each unit's journal.
    units = front_before_two_instances(supervisor, 0.3, '\n[vllm.args]\nmax_model_len = 4096\n\n[on_demand]\npark = "sleep"\nidle_timeout_s = 2.0\n')
    mark = supervisor.journal_mark()
    try:
        supervisor.run("systemctl", "start", *units, timeout=300)
        supervisor.run("systemctl", "start", "gb10d-front.service")

        def parked(name: str) -> bool:
            return supervisor.show(f"gb10d@{name}.service", "StatusText")["StatusText"].startswith("asleep")

        for name in ("alpha", "beta", "alpha"):  # each request finds its model parked: three wakes
            supervisor.wait_for(f"{name} to be parked", lambda name=name: parked(name), 120)
            status, body = http_post(supervisor, "http://127.0.0.1:8000/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 4})
            assert status == 200 and json.loads(body)["model"] == name, (name, status, body)
        supervisor.wait_for("alpha's second wake in its journal", lambda: supervisor.messages("gb10d@alpha.service", mark).count("\nwoke vLLM in") == 2)
        alpha = supervisor.messages("gb10d@alpha.service", mark)
        assert "checked it with a 16-token generation" in alpha and "vLLM sleeps (level 2) after" in alpha, alpha[-3000:]
        front = supervisor.messages("gb10d-front.service", mark)
        for name in FRONT_MODELS:
            assert f"parking {name}: no request for" in front, front
            assert f"waking {name}: 1 request(s) wait for it" in front, front
        for unit in units:
            shown = supervisor.show(unit, "ActiveState", "NRestarts")
            assert shown == {"ActiveState": "active", "NRestarts": "0"}, (unit, shown)
        status_text = supervisor.run("systemctl", "status", "--no-pager", "-n", "0", "gb10d@beta.service", check=False).stdout
        # Idle for 2 s, beta may be serving, falling asleep or asleep by now: systemctl says which, in words.
        assert re.search(r"Status: \"(serving beta|parking: putting vLLM to sleep|asleep: parked)", status_text), status_text
    finally:
        # The socket too: it holds port 8000, which the next test's gb10d.service gives its vLLM.
        supervisor.run("systemctl", "stop", "gb10d-front.service", "gb10d-front.socket", *units, check=False)
        supervisor.run("systemctl", "reset-failed", "gb10d-front.service", *units, check=False)
        supervisor.run("rm", "-f", "/etc/gb10d/alpha.toml", "/etc/gb10d/beta.toml")


def test_the_front_evicts_one_stopped_on_demand_model_for_the_other_and_systemctl_tells_the_story(supervisor: Container) -> None:
    # Two models of 0.5 x 121.69 GiB each: one fits in the 115 GiB free, two do not. Both gb10d@ units are active
    # and parked (vLLM stopped); each request for the model that is not running parks the other one first.
    units = front_before_two_instances(supervisor, 0.5, '\n[on_demand]\nidle_timeout_s = 600.0\n')
    mark = supervisor.journal_mark()
    try:
        supervisor.run("systemctl", "start", *units, "gb10d-front.service", timeout=300)
        for unit in units:
            shown = supervisor.show(unit, "ActiveState", "StatusText")
            assert shown["ActiveState"] == "active" and shown["StatusText"].startswith("parked: starts on the first request"), (unit, shown)
        for name in ("alpha", "beta", "alpha"):
            status, body = http_post(supervisor, "http://127.0.0.1:8000/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 4})
            assert status == 200 and json.loads(body)["model"] == name, (name, status, body)
        front = supervisor.messages("gb10d-front.service", mark)
        decisions = [line.split("gb10d-front: ", 1)[1].split(":")[0] for line in front.splitlines() if re.match(r"gb10d-front: (waking|evicting)", line)]
        assert decisions == ["waking alpha", "evicting alpha to make room for beta", "waking beta", "evicting beta to make room for alpha", "waking alpha"], front
        supervisor.wait_for("beta's park in its journal", lambda: "parked: starts on the first request" in supervisor.messages("gb10d@beta.service", mark))
        beta = supervisor.messages("gb10d@beta.service", mark)
        assert "as the front asked" in beta and "starting vLLM: the front asked for it, a request waits" in beta, beta[-3000:]
        assert not re.search(r"Free memory on device|is below gpu_memory_utilization", beta + supervisor.messages("gb10d@alpha.service", mark))
        assert supervisor.show("gb10d@beta.service", "StatusText")["StatusText"].startswith("parked: starts on the first request")
        assert supervisor.show("gb10d@alpha.service", "StatusText")["StatusText"].startswith("serving alpha")
        for unit in units:
            assert supervisor.show(unit, "NRestarts") == {"NRestarts": "0"}, unit
    finally:
        # The socket too: it holds port 8000, which the next test's gb10d.service gives its vLLM.
        supervisor.run("systemctl", "stop", "gb10d-front.service", "gb10d-front.socket", *units, check=False)
        supervisor.run("systemctl", "reset-failed", "gb10d-front.service", *units, check=False)
        supervisor.run("rm", "-f", "/etc/gb10d/alpha.toml", "/etc/gb10d/beta.toml")


def repacked(deb: Path, version: str, out: Path) -> Path:
    """The same package under a newer version: what an upgrade installs."""
    tree = out / "tree"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    control.write_text("".join(
        f"Version: {version}\n" if line.startswith("Version:") else line for line in control.read_text().splitlines(True)
    ))
    target = out / f"gb10d_{version}.deb"
    # gzip -1: xz, dpkg-deb's default, takes tens of seconds on a busy 2-core machine.
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", str(tree), str(target)], check=True, capture_output=True
    )
    return target


def test_upgrade_keeps_the_edited_conffile_and_does_not_restart(
    supervisor: Container, debian: Debian, build_deb: Callable[[str, str], Path], tmp_path: Path
) -> None:
    edited = sim_config() + "\n# edited by the admin\n"
    supervisor.write("/etc/gb10d.toml", edited)
    supervisor.run("systemctl", "start", UNIT)
    before = supervisor.show(UNIT, "MainPID")
    newer = supervisor.put(repacked(build_deb(debian.arch, debian.python), f"{gb10d_version()}+test1", tmp_path), "gb10d-newer.deb")
    # No terminal and no --force-conf*: dpkg must not need to ask anything.
    upgrade = supervisor.run("dpkg", "-i", newer)
    assert "restart pending" in upgrade.stdout, upgrade.stdout
    assert supervisor.read("/etc/gb10d.toml") == edited
    assert supervisor.show(UNIT, "ActiveState", "MainPID") == {"ActiveState": "active", **before}
    assert supervisor.run("dpkg-query", "-W", "-f", "${Version}", "gb10d").stdout == f"{gb10d_version()}+test1"


@emulated_too
def test_remove_stops_gb10d_and_purge_removes_state_but_keeps_models(supervisor: Container) -> None:
    supervisor.write("/etc/gb10d.toml", sim_config())
    supervisor.run("systemctl", "start", UNIT)
    supervisor.sh("echo weights > /var/cache/gb10d/model.bin")
    supervisor.run("dpkg", "-r", "gb10d")
    assert unit_processes(supervisor) == []
    assert supervisor.exists("/var/lib/gb10d"), "remove (not purge) keeps the state"
    supervisor.run("dpkg", "-P", "gb10d")
    assert not supervisor.exists("/var/lib/gb10d")
    assert not supervisor.exists("/etc/gb10d.toml")
    assert supervisor.exists("/var/cache/gb10d/model.bin"), "purge must keep downloaded models"
    assert supervisor.run("getent", "passwd", "gb10d", check=False).returncode == 0, "the user still owns the cache"
