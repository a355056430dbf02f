"""`gb10d run` supervising vLLM in a container, under docker and under rootful podman: the issue's scenario table.

Each test runs the real daemon (`python -m gb10d run`) with a real
NOTIFY_SOCKET; vLLM is gb10d.sim as the `vllm` of an image built from this
tree (tests/containers.py), run by the real engine. What is asserted is what
systemd, the journal, `gb10d status` and the engine's own list of
containers show: READY=1 once it serves, the corrected restart, the stall
and the next load strategy, the stale container of a SIGKILLed gb10d
removed by the next start, nothing left after a stop or a failure, a new
container for a new image, and the clear errors of a missing image, a bad
reference and an unreachable engine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from containers import (
    Registry,
    SlowLink,
    dead_socket,
    engine_or_skip,
    engine_run,
    ensure_sim_image,
    live_pull_clients,
    plain_http_registry,
    push_image,
    push_random_image,
    registries_conf,
    remove_image,
    run_args_for,
)
from gb10d.base.command import CONTAINER_LABEL, Engine, EngineKind
from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP
from harness import Daemon, NotifySocket, Setup, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "Qwen/Qwen3.6-27B-FP8"


@pytest.fixture(scope="module", params=["docker", "podman"])
def engine(request: pytest.FixtureRequest) -> Engine:
    kind: EngineKind = request.param
    return engine_or_skip(kind)


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    return ensure_sim_image(engine)


@dataclass
class ContainerSetup(Setup):
    """A deployment whose vLLM is the sim image under `engine`: the harness's config with [vllm] image and [container].

    The test's directory is mounted at the same path inside, so the meminfo
    file the sim reads for its free-memory check is the one the test writes.
    The sim holds none of its memory in that file: the engine kills a
    container's processes all at once, the sim's keeper that would give it
    back included, where a real kernel frees it.
    """

    engine: Engine = field(default_factory=lambda: Engine("docker", ("docker",)))
    image: str = ""

    def __post_init__(self) -> None:
        self.image_local = self.image  # the sim image as built here, whatever vllm.image names later
        self.sim_env = {"GB10D_SIM_MEMINFO_HOLD": "0", **self.sim_env}
        super().__post_init__()

    def data(self) -> dict[str, Any]:
        data = super().data()
        vllm = data["vllm"]
        del vllm["venv"]
        vllm.update(image=self.image, model=MODEL)
        data["container"] = {
            "engine": self.engine.kind,
            "gpu": "none",
            "cache_dir": str(self.root / "cache"),
            "name": f"gb10d-test-{os.getpid()}-{self.root.name[-20:]}".replace("_", "-"),
            "run_args": run_args_for(self.engine.kind),
            "pull": "never",
            "mounts": [f"{self.root}:{self.root}"],
            **data.get("container", {}),
        }
        return data

    @property
    def name(self) -> str:
        return str(self.data()["container"]["name"])


@pytest.fixture
def deployment(tmp_path: Path, engine: Engine, image: str) -> Iterator[ContainerSetup]:
    """A container deployment; whatever happened, no container of its config outlives the test."""
    setup = ContainerSetup(tmp_path, engine=engine, image=image)
    yield setup
    for name in containers(setup):
        engine_run(engine, "rm", "--force", name, check=False)


def containers(setup: ContainerSetup) -> list[str]:
    """The containers the engine holds for this config (running or not), by gb10d's label."""
    listed = engine_run(setup.engine, "ps", "--all", "--filter", f"label={CONTAINER_LABEL}={setup.config.absolute()}", "--format", "{{.Names}}")
    return listed.stdout.split()


def run(setup: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> Daemon:
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    return daemon


def ready(notify: NotifySocket, since: int = 0) -> dict[str, str]:
    return notify.wait_for(lambda m: m.get("READY") == "1", 120, since)


def starts(daemon: Daemon) -> list[str]:
    return [line for line in daemon.own_lines() if re.match(r"<\d>gb10d: started vLLM as container ", line)]


def status(setup: ContainerSetup) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gb10d", "status", "--config", str(setup.config)], capture_output=True, text=True, timeout=60)


def stopped_and_nothing_left(daemon: Daemon, setup: ContainerSetup) -> None:
    assert daemon.stop() == 0
    daemon.wait_line(r"gb10d: vLLM stopped")
    assert containers(setup) == [], "stop removes the container"


# --- the scenario table ---------------------------------------------------------------------------------


def test_healthy_start_is_ready_names_its_image_and_stop_leaves_nothing(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    daemon = run(deployment, notify, daemons)
    message = ready(notify)
    assert message["STATUS"].startswith(f"serving tiny on 127.0.0.1:{deployment.port}")
    ready_line = daemon.wait_line(r"gb10d: vLLM is ready after")
    assert "/health 200" in ready_line.string and "/v1/models lists tiny" in ready_line.string and "warm-up completion took" in ready_line.string
    image_line = daemon.wait_line(rf"gb10d: vLLM runs from the image {re.escape(deployment.image)} \((sha256:[0-9a-f]{{64}})\), as the container {deployment.name} \({deployment.engine.kind}\)")
    digest = image_line.group(1)
    [started] = starts(daemon)
    assert f"{deployment.engine.kind} run --name {deployment.name} " in started and f" {deployment.image} vllm serve {MODEL} " in started
    assert containers(deployment) == [deployment.name]

    state = json.loads(deployment.state_file.read_text())
    assert (state["image"], state["image_digest"], state["container"], state["engine"]) == (deployment.image, digest, deployment.name, deployment.engine.kind)
    shown = status(deployment)
    assert shown.returncode == 0, shown.stderr
    assert f"Image: {deployment.image} ({digest})" in shown.stdout
    assert f"Container: {deployment.name} ({deployment.engine.kind})" in shown.stdout

    stopped_and_nothing_left(daemon, deployment)


def test_free_memory_failure_is_one_corrected_restart_in_a_new_container(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # 0.92 of 121.69 GiB is 111.95 GiB but only 103.45 GiB are free (the meminfo the sim reads through the mount).
    deployment.free_gib, deployment.utilization = 103.45, 0.92
    deployment.extra["memory.preflight"] = False
    deployment.write_meminfo(103.45)
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    ready(notify)
    daemon.wait_line(r"gb10d: free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92 \(111.95 GiB\); restarting with 0.84 \(attempt 2/3\)")
    first, second = starts(daemon)
    assert "--gpu-memory-utilization 0.92" in first and "--gpu-memory-utilization 0.84" in second
    assert notify.count("READY", "1") == 1
    assert containers(deployment) == [deployment.name], "the failed start's container is removed before the next one runs"
    learned = (deployment.root / "lib" / "state.toml").read_text()
    assert "gpu_memory_utilization = 0.84" in learned and re.search(r'image_digest = "sha256:[0-9a-f]{64}"', learned), learned
    stopped_and_nothing_left(daemon, deployment)


def test_stall_is_a_restart_with_the_next_load_strategy(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    deployment.scenario = "stall_at=0"
    deployment.sim_env["GB10D_SIM_SHARDS"] = "66"
    deployment.extra["startup.stall_timeout_s"] = 3.0
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    daemon.wait_line(r"gb10d: no loading progress for \d+ s \(startup.stall_timeout_s 3\) at shard 0/66, and vLLM's processes did no I/O", 90)
    ready(notify)
    first, second = starts(daemon)
    assert "--safetensors-load-strategy" not in first and "--safetensors-load-strategy eager" in second
    assert containers(deployment) == [deployment.name]
    stopped_and_nothing_left(daemon, deployment)


def test_a_silent_shard_slower_than_the_stall_timeout_is_no_stall_while_the_container_reads(
    deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    # Each of the 2 shards takes 4 s without a line, longer than the 3 s stall timeout; the loader reads meanwhile,
    # and the gb10d user sees that in the container's cgroup, as it cannot read /proc/PID/io of root's processes.
    deployment.scenario = "slow_shards=400"
    deployment.sim_env["GB10D_SIM_SHARDS"] = "2"
    deployment.extra["startup.stall_timeout_s"] = 3.0
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    ready(notify)
    assert not [line for line in daemon.own_lines() if "no loading progress" in line]
    assert len(starts(daemon)) == 1
    stopped_and_nothing_left(daemon, deployment)


def test_the_start_after_a_sigkilled_gb10d_removes_its_container(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    first = run(deployment, notify, daemons)
    ready(notify)
    first.proc.send_signal(signal.SIGKILL)  # gb10d alone: its engine client and the container live on
    first.wait_exit()
    assert containers(deployment) == [deployment.name]
    left = engine_run(deployment.engine, "container", "inspect", "--format", "{{.Id}}", deployment.name).stdout.strip()

    since = len(notify.messages)
    second = run(deployment, notify, daemons)
    ready(notify, since)
    removed = second.wait_line(rf"gb10d: removed the container {deployment.name} \({left[:12]}, up [^)]*\) that an earlier gb10d left behind")
    assert removed.string.startswith("<4>")
    assert len(starts(second)) == 1
    now = engine_run(deployment.engine, "container", "inspect", "--format", "{{.Id}}", deployment.name).stdout.strip()
    assert now != left and containers(deployment) == [deployment.name]
    stopped_and_nothing_left(second, deployment)


def test_reload_with_a_new_image_tag_replaces_the_container(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    daemon = run(deployment, notify, daemons)
    ready(notify)
    before = engine_run(deployment.engine, "container", "inspect", "--format", "{{.Id}}", deployment.name).stdout.strip()
    tag = f"{deployment.image.rpartition(':')[0]}:reload-{os.getpid()}-{deployment.root.name[-12:]}"
    engine_run(deployment.engine, "tag", deployment.image, tag)
    try:
        since = len(notify.messages)
        old = deployment.image
        deployment.image = tag
        deployment.write_config()
        os.kill(daemon.proc.pid, signal.SIGHUP)
        daemon.wait_line(rf'gb10d: 1 key changed: vllm.image "{re.escape(old)}" -> "{re.escape(tag)}"; vLLM\'s command line changes: stopping vLLM')
        ready(notify, since)
        daemon.wait_line(rf"gb10d: vLLM runs from the image {re.escape(tag)} \(sha256:")
        assert f" {tag} vllm serve " in starts(daemon)[-1]
        after = engine_run(deployment.engine, "container", "inspect", "--format", "{{.Id}}", deployment.name).stdout.strip()
        assert after != before and containers(deployment) == [deployment.name]
        stopped_and_nothing_left(daemon, deployment)
    finally:
        remove_image(deployment.engine, tag)


def test_a_candidate_image_that_cannot_start_gives_way_to_the_good_one_and_a_working_one_becomes_good(
    deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = run(deployment, notify, daemons)
    ready(notify)
    good = deployment.image
    empty = image_without_vllm(deployment.engine, tmp_path)
    tag = f"{good.rpartition(':')[0]}:candidate-{os.getpid()}-{deployment.root.name[-12:]}"
    engine_run(deployment.engine, "tag", good, tag)
    try:
        since = len(notify.messages)
        deployment.image = empty
        deployment.write_config()
        os.kill(daemon.proc.pid, signal.SIGHUP)
        daemon.wait_line(rf"gb10d: the candidate {re.escape(empty)} \(vLLM of unknown version\) failed its start: .*; going back to the last "
                         rf"good {re.escape(good)} \(vLLM 0\.23\.0\) with the settings that served under it")
        ready(notify, since)
        assert f" {empty} vllm serve " in starts(daemon)[-2] and f" {good} vllm serve " in starts(daemon)[-1]
        assert containers(deployment) == [deployment.name]
        since = len(notify.messages)
        deployment.image = tag
        deployment.write_config()
        os.kill(daemon.proc.pid, signal.SIGHUP)
        ready(notify, since)
        daemon.wait_line(rf"gb10d: the candidate {re.escape(tag)} \(vLLM 0\.23\.0\) served: it is the good program from now on")
        stopped_and_nothing_left(daemon, deployment)
    finally:
        remove_image(deployment.engine, tag)
        remove_image(deployment.engine, empty)


# --- the clear errors ----------------------------------------------------------------------------------


def failed(daemon: Daemon, notify: NotifySocket, status_code: int, message: str) -> None:
    """gb10d gave up with `status_code`, saying `message` (a regex) in the journal, and its cause in STATUS=."""
    assert daemon.wait_exit(120) == status_code, daemon.tail()
    line = daemon.wait_line(rf"<3>gb10d: {message}")
    # systemctl status shows the cause the journal gives (cut at a word to fit), and where the fix is.
    status = notify.statuses()[-1]
    assert status.startswith("failed: ") and status.endswith("; the journal says how to fix it"), status
    # A cause too long for STATUS= is cut at a word and ends in "...".
    cause = status.removeprefix("failed: ").removesuffix("; the journal says how to fix it").removesuffix("...")
    assert cause in line.string, (status, line.string)


def test_a_missing_image_with_pull_never_is_a_config_error(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    absent = "localhost/gb10d-test/absent:1"
    deployment.image = absent
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    kind = deployment.engine.kind
    failed(daemon, notify, EXIT_CONFIG, re.escape(
        f'the image {absent} is not present in {kind} and container.pull is "never"; load it ({kind} pull {absent}, '
        f'or {kind} load -i FILE) or set container.pull = "missing"'
    ))
    assert starts(daemon) == [] and containers(deployment) == []


def test_a_malformed_image_reference_is_a_config_error(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    deployment.image = "nvcr.io/NVIDIA/vllm:26.05-py3"
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    assert daemon.wait_exit() == EXIT_CONFIG
    assert re.search(rf"gb10d: {re.escape(str(deployment.config))}:\d+: vllm.image: is not an image reference: the repository name must be lowercase", daemon.tail())
    assert containers(deployment) == []


def test_an_unreachable_engine_says_how_to_start_it(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    dead = dead_socket(deployment.root / "engine.sock")
    deployment.extra["container.socket"] = str(dead)
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    start_it = "sudo systemctl enable --now docker" if deployment.engine.kind == "docker" else "sudo systemctl enable --now podman.socket"
    failed(daemon, notify, EXIT_GAVE_UP, rf".*nothing answers on {re.escape(str(dead))}\); start it: {re.escape(start_it)}")
    assert starts(daemon) == []


def test_a_container_socket_that_is_not_there_is_a_config_error_not_a_restart_loop(
    deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    absent = deployment.root / "absent.sock"
    deployment.extra["container.socket"] = str(absent)
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    failed(daemon, notify, EXIT_CONFIG, rf"there is no socket {re.escape(str(absent))}: no engine can answer there; set container.socket")
    assert starts(daemon) == []


def image_without_vllm(engine: Engine, tmp_path: Path) -> str:
    """An image whose only file is a note: the container's init (tini, catatonit) cannot run vllm and says so."""
    root = tmp_path / "rootfs"
    root.mkdir()
    (root / "README").write_text("not a vLLM image\n")
    archive = tmp_path / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    empty = f"localhost/gb10d-test/empty:{os.getpid()}-{tmp_path.name[-12:]}"
    engine_run(engine, "import", str(archive), empty)
    return empty


def test_an_image_without_vllm_is_not_retried(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon], tmp_path: Path) -> None:
    empty = image_without_vllm(deployment.engine, tmp_path)
    try:
        deployment.image = empty
        deployment.write_config()
        daemon = run(deployment, notify, daemons)
        failed(daemon, notify, EXIT_CONFIG, re.escape(f"the image {empty} cannot run vllm") + r".*: it has no vllm program on its PATH; set vllm.image to a vLLM image")
        daemon.wait_line(rf"; {deployment.engine.kind} run --rm IMAGE vllm --version checks one$")
        assert sum("cannot run vllm" in line for line in daemon.own_lines()) == 1, "said once"
        assert len(starts(daemon)) == 1, "not retried"
        assert containers(deployment) == [], "the failed start's container is removed"
    finally:
        remove_image(deployment.engine, empty)


def test_nothing_is_left_after_a_give_up(deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]) -> None:
    deployment.scenario = "model_not_found"
    deployment.write_config()
    daemon = run(deployment, notify, daemons)
    assert daemon.wait_exit(120) == EXIT_CONFIG
    assert len(starts(daemon)) == 1 and containers(deployment) == []
    wait_until(lambda: containers(deployment) == [], 10, "no container of the config")


# --- pulling ---------------------------------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    with plain_http_registry(tmp_path, monkeypatch) as started:
        yield started


def with_random_layer(setup: ContainerSetup, size_mib: int) -> str:
    """The sim image plus a layer of `size_mib` random bytes (so a pull has that much to fetch), as a local image."""
    name, variant = f"{setup.name}-variant", f"localhost/gb10d-test/variant:{os.getpid()}-{setup.root.name[-12:]}"
    fill = f"import os\nopen('/random', 'wb').write(os.urandom({size_mib << 20}))"
    engine_run(setup.engine, "run", "--name", name, *run_args_for(setup.engine.kind), setup.image_local, "python3", "-c", fill)
    engine_run(setup.engine, "commit", name, variant)
    engine_run(setup.engine, "rm", name)
    return variant


def test_a_missing_image_is_pulled_with_progress_in_status_then_serves(
    deployment: ContainerSetup, registry: Registry, notify: NotifySocket, daemons: list[Daemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the random layer is new here, and the link brings it at 8 MiB/s: two seconds of a pull's progress.
    variant = with_random_layer(deployment, 16)
    digest = push_image(deployment.engine, variant, f"{registry.address}/gb10d/sim:{os.getpid()}")
    remove_image(deployment.engine, variant)
    link = SlowLink(registry.address, rate_bps=8 << 20)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(tmp_path, link.address)))
    remote = f"{link.address}/gb10d/sim:{os.getpid()}"
    try:
        deployment.image = remote
        deployment.extra["container.pull"] = "missing"
        deployment.write_config()
        daemon = run(deployment, notify, daemons)
        ready(notify)
        daemon.wait_line(rf'gb10d: pulling {re.escape(remote)} \(container.pull = "missing"\)')
        daemon.wait_line(rf"gb10d: pulled {re.escape(remote)} in \d+ s")
        daemon.wait_line(rf"gb10d: vLLM runs from the image {re.escape(remote)} \({digest}\), as the container")
        statuses = notify.statuses()
        pulling = [text for text in statuses if text.startswith(f"pulling {remote}")]
        downloaded = [float(m.group(1)) for text in pulling if (m := re.search(r": (\d+\.\d+) of \d+\.\d+ GB downloaded", text))]
        assert len(downloaded) >= 3 and downloaded == sorted(downloaded) and downloaded[0] < downloaded[-1], statuses
        first_start = next(i for i, (_, m) in enumerate(notify.messages) if m.get("STATUS", "").startswith("starting vllm"))
        assert any("EXTEND_TIMEOUT_USEC" in m for _, m in notify.messages[:first_start]), "the pull extends systemd's start timeout"
        stopped_and_nothing_left(daemon, deployment)
    finally:
        link.close()
        remove_image(deployment.engine, remote)


def test_a_stalled_pull_is_cancelled_pulled_again_and_given_up(
    deployment: ContainerSetup, registry: Registry, notify: NotifySocket, daemons: list[Daemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The link delivers 4 MiB of the 32 MiB layer, then nothing, holding the connection open.
    push_random_image(deployment.engine, tmp_path, f"{registry.address}/gb10d/stalled:1", size_mib=32)
    link = SlowLink(registry.address, rate_bps=8 << 20, stall_after=4 << 20)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(tmp_path, link.address)))
    image = f"{link.address}/gb10d/stalled:1"
    try:
        deployment.image = image
        deployment.extra.update({"container.pull": "missing", "startup.stall_timeout_s": 3.0, "restart.max_attempts": 2})
        deployment.write_config()
        daemon = run(deployment, notify, daemons)
        stalled = rf"the image's pull made no progress for \d+ s \(startup.stall_timeout_s 3\): pulling {re.escape(image)}.*; cancelling it"
        daemon.wait_line(rf"<3>gb10d: {stalled}")
        daemon.wait_line(r"<4>gb10d: pull_stalled: stalled while pulling .*; pulling again in 0.2 s \(attempt 2/2\)")
        failed(daemon, notify, EXIT_GAVE_UP, r"pull_stalled: stalled while pulling .*: giving up after 2 failed starts \(last: pull_stalled: stalled while pulling ")
        assert len([line for line in daemon.own_lines() if re.search(stalled, line)]) == 2
        assert starts(daemon) == [] and containers(deployment) == []
        assert live_pull_clients(image) == [], "cancelling the pull ends the engine's client"
    finally:
        link.close()
        remove_image(deployment.engine, image)


def digests(engine: Engine, reference: str) -> str:
    """The digests the engine lists for the local image (docker: the registry's; podman: every digest the image had
    under each of its names, its own manifest's first when it was made here before it was pushed, as in these tests)."""
    return engine_run(engine, "image", "inspect", "--format", "{{.RepoDigests}}", reference).stdout


def test_a_tag_that_moved_is_told_and_what_was_learned_with_the_old_image_is_not_applied(
    deployment: ContainerSetup, registry: Registry, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    remote = f"{registry.address}/gb10d/moving:{os.getpid()}"
    engine = deployment.engine
    first = push_image(engine, deployment.image, remote)
    variant = ""
    try:
        # The first image needs a lower utilization: 103.45 GiB free of 121.69 are too few for 0.92, so 0.84 is learned with it.
        deployment.image, deployment.utilization = remote, 0.92
        deployment.extra.update({"container.pull": "always", "memory.preflight": False})
        deployment.write_meminfo(103.45)
        deployment.write_config()
        daemon = run(deployment, notify, daemons)
        ready(notify)
        started = daemon.wait_line(rf"gb10d: vLLM runs from the image {re.escape(remote)} \((sha256:[0-9a-f]{{64}})\)").group(1)
        assert started == first or (engine.kind == "podman" and started in digests(engine, remote))
        assert daemon.stop() == 0
        assert f'image_digest = "{started}"' in (deployment.root / "lib" / "state.toml").read_text()

        # The registry's tag moves to another image (pushed under its other name, so this machine keeps the first).
        variant = with_random_layer(deployment, 1)
        second = push_image(engine, variant, remote.replace("127.0.0.1", "localhost"))
        deployment.write_meminfo(115.0)
        since = len(notify.messages)
        daemon = run(deployment, notify, daemons)
        ready(notify, since)
        moved = daemon.wait_line(
            rf"<4>gb10d: the tag {re.escape(remote)} now points to another image: (sha256:[0-9a-f]{{64}}) \(was {started}\); "
            "settings learned with the old image are not applied until this one has started"
        ).group(1)
        assert moved == second or (engine.kind == "podman" and moved in digests(engine, remote))
        daemon.wait_line(rf"gb10d: not applying the settings learned .* \(gpu_memory_utilization 0.84\): they were learned with the image "
                         rf"{re.escape(remote)} as {started}, and it is now {moved}, another vLLM; starting from the config's values")
        assert "--gpu-memory-utilization 0.92" in starts(daemon)[0]
        stopped_and_nothing_left(daemon, deployment)
    finally:
        for leftover in (remote, variant):
            if leftover:
                remove_image(engine, leftover)


def cleanup(setup: ContainerSetup) -> subprocess.CompletedProcess[str]:
    """`gb10d cleanup`, as the unit's ExecStopPost= runs it."""
    return subprocess.run([sys.executable, "-m", "gb10d", "cleanup", "--config", str(setup.config)], capture_output=True, text=True, timeout=120)


def test_cleanup_removes_the_container_of_a_dead_gb10d_and_refuses_while_one_runs(
    deployment: ContainerSetup, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    daemon = run(deployment, notify, daemons)
    ready(notify)
    refused = cleanup(deployment)
    assert refused.returncode == 1 and containers(deployment) == [deployment.name]
    assert refused.stderr == (
        f"gb10d: gb10d (pid {daemon.proc.pid}) is running with {deployment.config} and its container is in use; stop it first (systemctl stop gb10d)\n"
    )
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.wait_exit()
    removed = cleanup(deployment)
    assert removed.returncode == 0, removed.stderr
    assert re.fullmatch(rf"removed the container {deployment.name} \([0-9a-f]{{12}}, up [^)]*\) that an earlier gb10d left behind\n", removed.stdout)
    assert containers(deployment) == []
    again = cleanup(deployment)
    assert (again.returncode, again.stdout) == (0, f"no container of {deployment.config} is left\n")
