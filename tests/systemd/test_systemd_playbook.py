"""NVIDIA's playbook command, `-v ~/.cache/huggingface:/root/.cache/huggingface` included, to a unit that serves, under a real systemd.

The operator `ana` has a home of mode 0750 with the model already in
~/.cache/huggingface, and the playbook's `docker run` as start.sh. They
follow the README's "vLLM in a container" section as typed: import-script
as themselves, install, check-config, start. The unit must serve the model
found offline in the mounted cache (the stand-in fails an offline start
whose model is missing, and counts a download): no download, no warning,
no advice about the home's mode, which the engine does not need. The home
lies where the host's docker (which does the mounting) sees it at the same
path as the booted system.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from containers import engine_or_skip, ensure_sim_image
from harness import free_port
from systemd_harness import REPO, Container
from test_systemd_container import docker_box, host_docker
from test_systemd_e2e import MEMINFO, http_get, journal

pytestmark = [pytest.mark.systemd, pytest.mark.slow, pytest.mark.timeout(900)]

UNIT = "gb10d.service"
USER = "ana"
MODEL = "Qwen/Qwen2.5-Math-1.5B-Instruct"
PLAYBOOK_IMAGE = "nvcr.io/nvidia/vllm:26.05-py3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NAME = "gb10d-systemd-playbook-test"
PORT = free_port()
DOWNLOADED = "Time spent downloading weights for"
MISLEADING = re.compile(r"does not exist|not in the Hugging Face cache|Permission denied|chmod|usermod -aG|Traceback|" + DOWNLOADED)


def rig(cache: Path) -> str:
    """Not the operator's doing: the stand-in's speed, fixed memory figures, a free port and a container name of the test's own."""
    return f"""# the test rig
[vllm]
host = "127.0.0.1"
port = {PORT}

[vllm.env]
GB10D_SIM_SPEED = "0.01"

[memory]
meminfo_path = "{MEMINFO}"
preflight = false

[metrics]
listen = ""

[container]
gpu = "none"
pull = "never"
cache_dir = "{cache}"
name = "{NAME}"
"""


def operator_setup(home: str) -> str:
    """The operator as the playbook left them: a 0750 home, the model downloaded into ~/.cache/huggingface."""
    repo = f"{home}/.cache/huggingface/hub/models--{MODEL.replace('/', '--')}"
    return f"""
useradd --create-home --home-dir {home} --user-group --shell /bin/bash {USER}
chmod 0750 {home}
mkdir -p {repo}/refs {repo}/blobs {repo}/snapshots/{COMMIT}
printf {COMMIT} > {repo}/refs/main
for name in config.json model.safetensors; do
    echo "$name" > {repo}/blobs/$name.blob
    ln -s ../../blobs/$name.blob {repo}/snapshots/{COMMIT}/$name
done
chown -R {USER}:{USER} {home}
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, build_deb: Callable[[str, str], Path]) -> Iterator[tuple[Container, str]]:
    """The booted system with the operator, their start.sh (the playbook's command, on the stand-in's image) and the rig."""
    image = ensure_sim_image(engine_or_skip("docker"))
    homes, cache = tmp_path_factory.mktemp("homes"), tmp_path_factory.mktemp("playbook-cache")
    homes.chmod(0o755)  # like /home: the operator may pass through to their own home
    home = f"{homes}/{USER}"
    try:
        with docker_box(tmp_path_factory, build_deb, (homes, cache)) as container:
            container.sh(operator_setup(home))
            playbook = (REPO / "tests" / "fixtures" / "scripts" / "playbook.sh").read_text()
            container.write(f"{home}/start.sh", playbook.replace(PLAYBOOK_IMAGE, image), mode="0755")
            container.run("chown", f"{USER}:{USER}", f"{home}/start.sh")
            container.write("/etc/gb10d.d/90-test-rig.toml", rig(cache))
            yield container, home
    finally:
        host_docker("rm", "--force", NAME)


def test_the_playbooks_command_serves_the_model_from_the_mounted_cache_offline(box: tuple[Container, str]) -> None:
    container, home = box
    # The README's commands, as typed.
    imported = container.run("runuser", "-l", USER, "-c", "gb10d import-script start.sh > gb10d.toml")
    assert imported.stderr == "", imported.stderr
    container.run("install", "-m", "0644", f"{home}/gb10d.toml", "/etc/gb10d.toml")
    config = container.read("/etc/gb10d.toml")
    assert f'"{home}/.cache/huggingface:/root/.cache/huggingface"' in config, config
    assert 'HF_HUB_CACHE = "/root/.cache/huggingface/hub"' in config and 'HF_HUB_OFFLINE = "1"' in config, config
    assert f"# note: read ~ as {home}" in config and "# warning:" not in config and not MISLEADING.search(config), config
    check = container.run("gb10d", "check-config", check=False)
    assert check.returncode == 0 and check.stdout.startswith("OK") and check.stderr == "", check.stdout + check.stderr
    cursor = container.run("journalctl", "-n", "0", "--show-cursor").stdout.split("cursor: ")[-1].strip()
    try:
        container.run("systemctl", "start", UNIT)
        state = container.show(UNIT, "ActiveState", "StatusText")
        assert state["ActiveState"] == "active" and state["StatusText"].startswith("serving"), state
        models = http_get(container, f"http://127.0.0.1:{PORT}/v1/models")[1]
        assert f'"id":"{MODEL}"' in models.replace(" ", ""), models
    finally:
        container.run("systemctl", "stop", UNIT)
    log = journal(container, UNIT, f"--after-cursor={cursor}")
    assert f"started vLLM as container {NAME}" in log, log[-3000:]
    assert not MISLEADING.search(log), MISLEADING.search(log)
