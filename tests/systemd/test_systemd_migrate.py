"""Coming from a start.sh, exactly as the README's section of that name tells the operator, under a real systemd.

The operator `hayashi` has a home of mode 0750 (Ubuntu 24.04's default), a
vLLM venv in it whose `vllm` is gb10d.sim, the model already downloaded into
~/.cache/huggingface, warm compile caches in ~/.cache/vllm, and the
reference start script. They install the package, translate the script,
check, and start: first without a fix (the start fails and the journal names
the home and both ways out), then each supported way, which must reach READY
with no download and no misleading line in the journal. The tests run in
file order and share one container.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from systemd_harness import REPO, Container, Debian
from test_systemd_e2e import MEMINFO, http_get, set_memory

pytestmark = [pytest.mark.systemd, pytest.mark.slow, pytest.mark.timeout(900)]

UNIT = "gb10d.service"
USER = "hayashi"
HOME = f"/home/{USER}"
VENV = f"{HOME}/vllm-pip-env"
MODEL = "Qwen/Qwen3.6-27B-FP8"
HUB = f"{HOME}/.cache/huggingface/hub"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
DOWNLOADED = "Time spent downloading weights for"
# Lines that would send the operator the wrong way: a missing file that exists, a permission error with no cause.
MISLEADING = re.compile(r"does not exist|is not executable|is not in the Hugging Face cache|Permission denied|Read-only file system|Traceback|" + DOWNLOADED)

# The venv's `vllm`: pip's script, run by the venv's python, here starting gb10d.sim from the package's tree.
VLLM_SCRIPT = f"""#!{VENV}/bin/python3 -I
import runpy
import sys

sys.path.insert(0, "/usr/lib/gb10d/site-packages")
runpy.run_module("gb10d.sim", run_name="__main__", alter_sys=True)
"""
# The operator's machine as the start script left it: umask 002 files, a 0750 home (useradd on Ubuntu 24.04).
OPERATOR_SETUP = f"""
useradd --create-home --user-group --shell /bin/bash {USER}
chmod 0750 {HOME}
cd {HOME}
umask 002
mkdir -p {VENV}/bin .cache/vllm/torch_compile_cache/a33744ddfd
ln -s /usr/bin/python3 {VENV}/bin/python3
printf 'VIRTUAL_ENV={VENV}\\n' > {VENV}/bin/activate
repo={HUB}/models--Qwen--Qwen3.6-27B-FP8
mkdir -p $repo/refs $repo/blobs $repo/snapshots/{COMMIT}
printf {COMMIT} > $repo/refs/main
for name in config.json model-00001-of-00002.safetensors model-00002-of-00002.safetensors; do
    echo "$name" > $repo/blobs/$name.blob
    ln -s ../../blobs/$name.blob $repo/snapshots/{COMMIT}/$name
done
chown -R {USER}:{USER} {HOME}
"""
# Not the operator's doing: the test rig's fast stand-in and fixed memory figures, in a config drop-in.
RIG = f"""# the test rig: gb10d.sim at 1/100 of real time, reading fixed memory figures
[vllm.env]
GB10D_SIM_SPEED = "0.01"
GB10D_SIM_MEMINFO = "{MEMINFO}"

[memory]
meminfo_path = "{MEMINFO}"
preflight = false
"""


def start_script() -> str:
    """The reference script as its first user runs it: it also names a log file and removes the old one first,
    and activates the venv as the README's example does, through `~`."""
    lines = (REPO / "tests" / "fixtures" / "scripts" / "reference.sh").read_text().splitlines(keepends=True)
    log = 'LOG_FILE=~/vllm.log\nif [ -f "$LOG_FILE" ]; then rm "$LOG_FILE"; fi\n'
    script = "#!/bin/bash\n" + "".join(lines[:3]) + log + "".join(lines[3:])
    return script.replace('source "${ENV_DIR}/bin/activate"', "source ~/vllm-pip-env/bin/activate")




def as_operator(box: Container, command: str, check: bool = True) -> str:
    """A command in the operator's login shell, as they would type it; stdout and stderr together."""
    done = box.run("runuser", "-l", USER, "-c", command, check=check)
    return done.stdout + done.stderr


def started_serving(box: Container, since: int) -> str:
    """`systemctl start gb10d` must return with gb10d serving; the journal of that start."""
    box.run("systemctl", "start", UNIT)
    state = box.show(UNIT, "ActiveState", "StatusText")
    assert state["ActiveState"] == "active" and state["StatusText"].startswith("serving"), state
    models = http_get(box, "http://127.0.0.1:8000/v1/models")[1]
    assert '"id":"Qwen3.6-27B-FP8-Agent"' in models.replace(" ", ""), models
    return box.messages(UNIT, since)


@pytest.fixture(scope="module")
def operator(container: Container, debian: Debian, build_deb: Callable[[str, str], Path]) -> Container:
    """The operator's machine with the package installed and their start script translated into /etc/gb10d.toml."""
    container.sh(OPERATOR_SETUP)
    container.write(f"{VENV}/bin/vllm", VLLM_SCRIPT, mode="0775")
    container.run("chown", f"{USER}:{USER}", f"{VENV}/bin/vllm")
    script = start_script()
    container.write(f"{HOME}/start.sh", script, mode="0755")
    container.run("chown", f"{USER}:{USER}", f"{HOME}/start.sh")
    set_memory(container, total_gib=121.69, free_gib=115.0)
    container.write("/etc/gb10d.d/90-test-rig.toml", RIG)
    # The README's commands, in its order.
    container.run("dpkg", "-i", container.put(build_deb(debian.arch, debian.python), "gb10d.deb"))
    as_operator(container, "gb10d import-script ~/start.sh > gb10d.toml")
    container.run("install", "-m", "0644", f"{HOME}/gb10d.toml", "/etc/gb10d.toml")
    return container


def test_import_script_points_at_the_model_already_downloaded_and_says_what_changes(operator: Container) -> None:
    config = operator.read("/etc/gb10d.toml")
    assert f'venv = "{VENV}"' in config
    assert f"# note: read ~ as {HOME}, as when {USER} runs the script: the service has another home" in config
    assert "relative to the directory" not in config and "is not set in the script" not in config
    assert f'HF_HUB_CACHE = "{HUB}"' in config and 'HF_HUB_OFFLINE = "1"' in config
    assert f"# note: {MODEL} is already in {USER}'s Hugging Face cache {HUB}" in config
    assert f"# note: the service runs vLLM as the system user gb10d, not as {USER} who ran this script" in config
    assert '# note: line 6: `if [ -f "$LOG_FILE" ]; then rm "$LOG_FILE"; fi` has no effect on vLLM under gb10d; ignored' in config
    assert f"no longer to {HOME}/vllm.log" in config
    assert f"# warning: as things are, the service user gb10d cannot use this: {HOME} is mode 0750 and the service user gb10d may not enter it" in config


def test_without_a_fix_the_start_fails_naming_the_home_and_both_ways_out(operator: Container) -> None:
    check = operator.run("gb10d", "check-config", check=False)
    assert check.returncode == 78, check.stdout + check.stderr
    since = operator.journal_mark()
    assert operator.run("systemctl", "start", UNIT, check=False).returncode != 0
    state = operator.show(UNIT, "ActiveState", "ExecMainStatus", "NRestarts")
    assert state == {"ActiveState": "failed", "ExecMainStatus": "78", "NRestarts": "0"}, state
    log = operator.messages(UNIT, since)
    for text in (check.stderr, log):
        assert f"vllm.venv: the program {VENV}/bin/vllm exists, but {HOME} is mode 0750 and the service user gb10d may not enter it" in text, text
        # Root sees the model there; gb10d itself cannot look, and says what is in the way rather than that it is missing.
        assert re.search(rf"vllm\.env\.HF_HUB_CACHE: {MODEL} (is|may be) in the Hugging Face cache {HUB} \(HF_HUB_CACHE from \[vllm\.env\]\), "
                         rf"but {HOME} is mode 0750 and the service user gb10d may not enter it", text), text
        assert f"sudo gb10d service-user {USER}" in text and f"sudo usermod -aG {USER} gb10d" in text, text
        assert not MISLEADING.search(text), MISLEADING.search(text)
    operator.run("systemctl", "reset-failed", UNIT)


def test_keeping_the_system_user_with_access_to_the_home_serves_the_downloaded_model(operator: Container) -> None:
    operator.run("usermod", "-aG", USER, "gb10d")
    check = operator.run("gb10d", "check-config")
    assert "paths checked as gb10d (the user gb10d.service runs as)" in check.stdout and check.stderr == "", check.stdout + check.stderr
    since = operator.journal_mark()
    try:
        log = started_serving(operator, since)
    finally:
        operator.run("systemctl", "stop", UNIT)
        operator.run("gpasswd", "-d", "gb10d", USER)
    assert not MISLEADING.search(log), MISLEADING.search(log)
    assert "Using cache directory: /var/cache/gb10d/vllm/torch_compile_cache" in log


def test_running_as_the_operator_serves_with_their_own_caches(operator: Container) -> None:
    out = operator.run("gb10d", "service-user", USER).stdout
    assert f"wrote /etc/systemd/system/{UNIT}.d/50-service-user.conf" in out, out
    check = operator.run("gb10d", "check-config")
    assert f"paths checked as {USER} (the user gb10d.service runs as)" in check.stdout, check.stdout
    # The user lingers, so logind's RemoveIPC= leaves vLLM's semaphores alone at logout: no warning.
    assert operator.exists(f"/var/lib/systemd/linger/{USER}") and "RemoveIPC" not in check.stderr, check.stderr
    since = operator.journal_mark()
    try:
        log = started_serving(operator, since)
        owners = operator.run("ps", "-o", "user=", "--ppid", operator.show(UNIT, "MainPID")["MainPID"]).stdout.split()
    finally:
        operator.run("systemctl", "stop", UNIT)
    assert owners and set(owners) == {USER}, owners
    assert not MISLEADING.search(log), MISLEADING.search(log)
    assert f"Using cache directory: {HOME}/.cache/vllm/torch_compile_cache" in log


def test_back_to_the_system_user_and_the_services_own_empty_cache_the_download_is_counted(operator: Container) -> None:
    # The control: the same count is not zero when the model must come from the network.
    operator.run("gb10d", "service-user", "gb10d")
    operator.write("/etc/gb10d.d/95-own-cache.toml", '[vllm.env]\nHF_HUB_CACHE = "/var/cache/gb10d/huggingface/hub"\nHF_HUB_OFFLINE = "0"\n')
    operator.run("usermod", "-aG", USER, "gb10d")
    since = operator.journal_mark()
    try:
        log = started_serving(operator, since)
    finally:
        operator.run("systemctl", "stop", UNIT)
        operator.run("rm", "/etc/gb10d.d/95-own-cache.toml")
    assert log.count(DOWNLOADED) == 1, log
