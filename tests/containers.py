"""Real container engines for the tests: docker and podman, an image whose `vllm` is gb10d.sim, a local registry.

No registry on the internet is reachable from the test machines, so the
image is built here: a root file system holding only this Python (its
interpreter, standard library and the shared libraries they load) and the
gb10d package, imported into the engine as one layer. Its tag is a hash of
what went into it, so it is built once per change of gb10d, not per run.
A registry, where one is needed, is Debian's docker-registry on a free port
of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Iterator

import pytest

from gb10d.base.command import Engine, EngineKind, engine_client
from gb10d.launch.engine import probe
from harness import free_port

ROOT = Path(__file__).parent.parent
SIM_REPOSITORY = "localhost/gb10d-test/sim"
# The image's vllm, as the packaged one in tests/systemd: the sim, from the copy of gb10d in the image.
VLLM_SCRIPT = """#!/usr/bin/python3 -I
import runpy
import sys

sys.path.insert(0, "/opt/gb10d")
runpy.run_module("gb10d.sim", run_name="__main__", alter_sys=True)
"""
# What a registry may hold for a tag: docker's and OCI's manifests (and their lists).
MANIFEST_TYPES = ", ".join([
    "application/vnd.docker.distribution.manifest.v2+json", "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json",
])
_SKIPPED_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages", "dist-packages"}
_CAP_SYS_RESOURCE = 24


def require_engines() -> bool:
    """Where the CI installs both engines, a missing one fails the run instead of skipping the test."""
    return os.environ.get("GB10D_REQUIRE_CONTAINER_ENGINES") == "1"


def dead_socket(path: Path) -> Path:
    """A socket file nobody listens on: an engine's socket while its daemon is not running."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
    return path


def engine_or_skip(kind: EngineKind, socket: Path | None = None) -> Engine:
    """The engine's client, or a skip (a failure under GB10D_REQUIRE_CONTAINER_ENGINES=1) saying why it is unusable."""
    engine = engine_client(kind, socket, as_root=os.geteuid() == 0)
    problem = probe(engine)
    if problem is not None:
        message = f"{kind} is not usable here: {problem}"
        if require_engines():
            pytest.fail(message)
        pytest.skip(message)
    return engine


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False


def run_args_for(kind: EngineKind) -> list[str]:
    """Limits podman must be given where root lacks CAP_SYS_RESOURCE (some sandboxes).

    Rootful podman raises the container's open-files and process limits to
    its own maxima, which needs that capability; without it the start fails
    with "error setting rlimit". Docker leaves the limits alone.
    """
    if kind != "podman" or _has_cap_sys_resource():
        return []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def engine_run(engine: Engine, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One engine command, as a person would type it."""
    done = subprocess.run([*engine.client, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(engine.client)} {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done


def container_exists(engine: Engine, name: str) -> bool:
    return engine_run(engine, "container", "inspect", name, check=False).returncode == 0


def container_running(engine: Engine, name: str) -> bool:
    done = engine_run(engine, "container", "inspect", "--format", "{{.State.Running}}", name, check=False)
    return done.returncode == 0 and done.stdout.strip() == "true"


def _interpreter_files() -> tuple[Path, Path, set[Path]]:
    """This Python's real interpreter, its standard library, and every shared library they load."""
    exe = Path(os.path.realpath(sys.executable))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or stdlib / "lib-dynload")
    libs: set[Path] = set()
    for binary in [exe, *dynload.glob("*.so")]:
        listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        libs |= {Path(p) for p in re.findall(r"(/\S+\.so[\w.]*)", listed)}
    return exe, stdlib, libs


def _sources() -> list[Path]:
    return sorted(p for p in (ROOT / "gb10d").rglob("*.py") if "__pycache__" not in p.parts)


def sim_image_tag() -> str:
    """The tag of the image for this tree and this Python: a hash of the gb10d sources, the builder and the interpreter."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + sys.version.encode())
    for source in _sources():
        digest.update(str(source.relative_to(ROOT)).encode() + source.read_bytes())
    return f"{SIM_REPOSITORY}:{digest.hexdigest()[:16]}"


def build_rootfs(root: Path) -> None:
    """A root file system with this Python, gb10d, and /usr/local/bin/vllm running gb10d.sim."""
    exe, stdlib, libs = _interpreter_files()

    for lib in libs | {exe}:
        shutil.copy2(os.path.realpath(lib), _place(root, lib.relative_to("/")))
    shutil.copytree(stdlib, _place(root, stdlib.relative_to("/")), symlinks=True, ignore=lambda _d, names: [n for n in names if n in _SKIPPED_STDLIB])
    _place(root, Path("usr/bin/python3")).symlink_to(exe)
    package = root / "opt/gb10d/gb10d"
    for source in _sources():
        shutil.copy2(source, _place(package, source.relative_to(ROOT / "gb10d")))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    vllm = root / "usr/local/bin/vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text(VLLM_SCRIPT)
    vllm.chmod(0o755)
    (root / "tmp").mkdir(mode=0o1777)
    (root / "tmp").chmod(0o1777)


def _place(base: Path, relative: Path) -> Path:
    """`base/relative`, its directory created."""
    target = base / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def import_rootfs(engine: Engine, root: Path, reference: str) -> None:
    """The root file system as a one-layer image named `reference` (`ENGINE import`)."""
    with tempfile.TemporaryDirectory() as scratch:
        archive = Path(scratch) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname=".")
        engine_run(engine, "import", "--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin", str(archive), reference, timeout=600)


# Another tree's sim image younger than this may be in use by a test run of that tree on the same engine.
STALE_IMAGE_S = 24 * 3600


def ensure_sim_image(engine: Engine) -> str:
    """The sim image in this engine, built if this tree's tag is missing; other trees' tags of it a day old are removed."""
    reference = sim_image_tag()
    if engine_run(engine, "image", "inspect", reference, check=False).returncode == 0:
        return reference
    with tempfile.TemporaryDirectory() as scratch:
        build_rootfs(Path(scratch) / "root")
        import_rootfs(engine, Path(scratch) / "root", reference)
    listed = engine_run(engine, "images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
    for old in listed:
        if old.startswith(f"{SIM_REPOSITORY}:") and old != reference and _age_s(engine, old) > STALE_IMAGE_S:
            engine_run(engine, "rmi", "--force", old, check=False)
    return reference


def _age_s(engine: Engine, reference: str) -> float:
    """How long ago the image was made; 0 if unknown. docker writes `Created` as RFC 3339, podman as Go's
    default (`2026-12-04 08:44:33.99984106 +0000 UTC`), both with up to nanoseconds."""
    created = engine_run(engine, "image", "inspect", "--format", "{{.Created}}", reference, check=False).stdout.strip()
    match = re.match(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:\.\d+)?\s*(Z|[+-]\d\d:?\d\d)", created)
    if match is None:
        return 0.0
    offset = "+00:00" if match.group(3) == "Z" else match.group(3)[:3] + ":" + match.group(3)[-2:]
    made = datetime.fromisoformat(f"{match.group(1)}T{match.group(2)}{offset}")
    return (datetime.now(UTC) - made).total_seconds()


def remove_image(engine: Engine, reference: str) -> None:
    """Remove the tag, and the digests docker keeps of its repository after a pull or push (the image itself goes with its last name).

    podman keeps no digest names of their own (its RepoDigests are each name
    with each digest), and `podman rmi NAME@DIGEST` would remove the image
    under all its names.
    """
    engine_run(engine, "rmi", "--force", reference, check=False)
    if engine.kind != "docker":
        return
    repository = reference.rsplit(":", 1)[0] if ":" in reference.rsplit("/", 1)[-1] else reference
    listed = engine_run(engine, "images", "--digests", "--format", "{{.Repository}} {{.Digest}}", repository, check=False).stdout.split("\n")
    for line in listed:
        name, _, digest = line.partition(" ")
        if name == repository and digest.startswith("sha256:"):
            engine_run(engine, "rmi", f"{name}@{digest}", check=False)


def push_image(engine: Engine, local: str, reference: str) -> str:
    """Push the local image `local` as `reference` (REGISTRY/REPOSITORY:TAG), leaving no local tag of it; the registry's digest.

    The digest is asked of the registry: podman converts the image on push,
    so its local digest is not the one a pull will find.
    """
    if local != reference:
        engine_run(engine, "tag", local, reference)
    engine_run(engine, "push", *(["--tls-verify=false"] if engine.kind == "podman" else []), reference, timeout=600)
    engine_run(engine, "rmi", reference)  # the tag only: `local` keeps the image
    registry, _, rest = reference.partition("/")
    repository, _, tag = rest.rpartition(":")
    request = urllib.request.Request(f"http://{registry}/v2/{repository}/manifests/{tag}", method="HEAD", headers={"Accept": MANIFEST_TYPES})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return str(answer.headers["Docker-Content-Digest"])


def push_random_image(engine: Engine, tmp_path: Path, reference: str, size_mib: int = 64) -> str:
    """A one-layer image of random bytes (so no layer is present already), pushed as `reference`; the registry's digest of it."""
    root = tmp_path / f"layer-{time.monotonic_ns()}"
    root.mkdir()
    (root / "blob").write_bytes(os.urandom(size_mib << 20))
    archive = tmp_path / f"{root.name}.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(archive), "."], check=True)
    engine_run(engine, "import", str(archive), reference)
    return push_image(engine, reference, reference)


@dataclass
class Registry:
    """A docker-registry on 127.0.0.1, plain HTTP; `auth` when it demands a password."""

    address: str
    process: subprocess.Popen[bytes]
    directory: Path

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# The htpasswd line of user `gb10d` with password `gb10d-test-password` (bcrypt, as docker-registry requires).
HTPASSWD = "gb10d:$2b$05$abcdefghijklmnopqrstuuyIg1BD9CAKGJh4RewZyG9ymiFVcIlLS\n"


def start_registry(directory: Path, auth: bool = False) -> Registry:
    """Debian's docker-registry serving `directory` on a free port; ready when its /v2/ answers."""
    program = shutil.which("docker-registry")
    if program is None:
        message = "docker-registry (Debian's package of the distribution registry) is not installed"
        if require_engines():
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    config = [
        "version: 0.1",
        "log:\n  level: error",
        f"storage:\n  filesystem:\n    rootdirectory: {directory / 'data'}\n  delete:\n    enabled: true",
        f"http:\n  addr: 127.0.0.1:{port}",
    ]
    if auth:
        (directory / "htpasswd").write_text(HTPASSWD)
        config.append(f"auth:\n  htpasswd:\n    realm: gb10d-test\n    path: {directory / 'htpasswd'}")
    (directory / "config.yml").write_text("\n".join(config) + "\n")
    process = subprocess.Popen([program, "serve", str(directory / "config.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    registry = Registry(f"127.0.0.1:{port}", process, directory)
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://{registry.address}/v2/", timeout=5)
            return registry
        except urllib.error.HTTPError:
            return registry  # 401 from an authenticating registry: it is up
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                registry.stop()
                raise AssertionError(f"docker-registry did not come up on {registry.address}") from None
            time.sleep(0.05)


@contextlib.contextmanager
def plain_http_registry(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """A local registry that podman (and whatever it runs, gb10d included) may use over plain HTTP; docker allows 127.0.0.1 by itself."""
    started = start_registry(directory / "registry")
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(directory, started.address, started.address.replace("127.0.0.1", "localhost"))))
    try:
        yield started
    finally:
        started.stop()


def registries_conf(directory: Path, *addresses: str) -> Path:
    """A podman registries.conf that lets it talk plain HTTP to the test registries (docker allows localhost by itself)."""
    path = directory / "registries.conf"
    path.write_text("".join(f'[[registry]]\nlocation = "{address}"\ninsecure = true\n' for address in addresses))
    return path


class SlowLink:
    """A TCP relay to `upstream` that sends at most `rate_bps` back, and nothing more after `stall_after` bytes.

    It stands for a slow or stalling network between the engine and a
    registry: the engine then reports a layer's bytes as they come, or stops
    reporting them when the link stalls.
    """

    def __init__(self, upstream: str, rate_bps: int, stall_after: int | None = None) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._rate = rate_bps
        self._stall_after = stall_after
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sent = 0
        # Set once the link has sent its `stall_after` bytes and holds everything after them.
        self.stalled = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            self._open += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, True), daemon=True).start()

    def _relay(self, source: socket.socket, target: socket.socket, throttled: bool) -> None:
        try:
            while data := source.recv(1 << 14):
                if throttled:
                    with self._lock:
                        if self._stall_after is not None and self._sent >= self._stall_after:
                            self.stalled.set()
                            threading.Event().wait()  # the link stalls: hold the connection open, send nothing
                        self._sent += len(data)
                    time.sleep(len(data) / self._rate)
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        for end in self._open:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
                end.close()


def live_pull_clients(image: str) -> list[int]:
    """The engine clients still pulling `image` (their command line names it)."""
    from harness import live_pids

    return live_pids(lambda entry, _fields: b"pull" in (entry / "cmdline").read_bytes().split(b"\0") and image.encode() in (entry / "cmdline").read_bytes())


def sigterm_ignoring_program() -> list[str]:
    """An argv for the image that ignores SIGTERM and sleeps: a vLLM that does not drain."""
    return ["python3", "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ignoring SIGTERM', flush=True)\ntime.sleep(3600)"]

