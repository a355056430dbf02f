"""Container images, purely: references, what a pull reports, why a pull failed, and which digest was started.

Everything here decides from text the engine printed or the operator wrote;
`container` runs the engine and feeds these functions. The pull is read the
way the engine draws it on a terminal (`docker pull` and `podman pull` print
byte counts only to a terminal), so a layer that is still downloading is
progress and a pull that stopped moving is a stall.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from .errors import EXIT_CONFIG, EXIT_GAVE_UP, Gb10dError

# The grammar of docker/distribution's reference package, which both engines use.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
_EXAMPLE = 'e.g. "nvcr.io/nvidia/vllm:26.05-py3"'


@dataclass(frozen=True)
class ImageRef:
    """An image reference as written: registry, repository path, tag and digest."""

    text: str
    domain: str | None
    path: str
    tag: str | None
    digest: str | None

    @property
    def repository(self) -> str:
        """`nvcr.io/nvidia/vllm` of `nvcr.io/nvidia/vllm:26.05-py3`."""
        return f"{self.domain}/{self.path}" if self.domain else self.path

    @property
    def moves(self) -> bool:
        """Whether the reference can point to another image tomorrow (a tag, not a digest)."""
        return self.digest is None


def parse_reference(text: str) -> ImageRef:
    """The reference's parts; ValueError with what is wrong, in the words an operator needs."""
    if not text.strip():
        raise ValueError(f"must name a container image, {_EXAMPLE}")
    if text != text.strip() or any(c.isspace() for c in text):
        raise ValueError(f"is not an image reference: it contains blanks (got {text!r}); {_EXAMPLE}")
    if "://" in text:
        raise ValueError(f"is an image reference, not a URL: drop the scheme (got {text!r}); {_EXAMPLE}")
    match = _REFERENCE.fullmatch(text)
    if match is None:
        first, _, rest = text.partition("/")
        path = rest if rest and ("." in first or ":" in first or first == "localhost") else text
        if path.split("@")[0].split(":")[0] != path.split("@")[0].split(":")[0].lower():
            raise ValueError(f"is not an image reference: the repository name must be lowercase (got {text!r}); {_EXAMPLE}")
        raise ValueError(
            f"is not an image reference (got {text!r}): it must be [REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST], {_EXAMPLE}"
        )
    domain, path = match.group("domain"), match.group("path")
    if domain is not None and "." not in domain and ":" not in domain and domain != "localhost" and not domain.startswith("["):
        # docker reads `nvidia/vllm` as a Docker Hub repository, not as the registry `nvidia`.
        path, domain = f"{domain}/{path}", None
    if len(f"{domain}/{path}" if domain else path) > 255:
        raise ValueError(f"is not an image reference: the repository name is longer than 255 characters (got {text!r})")
    return ImageRef(text, domain, path, match.group("tag"), match.group("digest"))


# --- what a pull reports -------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_SIZES = re.compile(r"(?P<done>\d+(?:\.\d+)?)\s*(?P<done_unit>[kKMGT]?i?B|b)\s*/\s*(?P<total>\d+(?:\.\d+)?)\s*(?P<total_unit>[kKMGT]?i?B|b)")
_UNITS = {"b": 1, "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "kiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# docker: `aac5b88e52fe: Downloading [==>   ]  18.71MB/300.1MB` (the bar only on a wide terminal), `aac5b88e52fe: Pull complete`
_DOCKER_LAYER = re.compile(r"(?P<id>[0-9a-f]{12,64}): (?P<status>[A-Za-z][A-Za-z ]*?)\s*(?:\[[^\]]*\])?\s*(?P<sizes>\S+/\S+)?")
# podman: `Copying blob aac5b88e52fe [====>---] 21.0MiB / 286.2MiB`, `Copying blob aac5b88e52fe done`
_PODMAN_BLOB = re.compile(r"Copying blob (?:sha256:)?(?P<id>[0-9a-f]{12,64})(?P<rest>.*)")


def _sizes(text: str) -> tuple[int, int] | None:
    """(done, total) bytes of `18.71MB/300.1MB` or `21.0MiB / 286.2MiB`."""
    match = _SIZES.search(text)
    if match is None:
        return None
    return (int(float(match["done"]) * _UNITS.get(match["done_unit"], 1)),
            int(float(match["total"]) * _UNITS.get(match["total_unit"], 1)))


@dataclass(frozen=True)
class Layer:
    """One layer of the image being pulled, as far as the engine has said."""

    downloaded_bytes: int = 0
    unpacked_bytes: int = 0
    total_bytes: int = 0
    phase: str = "waiting"

    @property
    def complete(self) -> bool:
        return self.phase == "complete"


@dataclass(frozen=True)
class PullProgress:
    """A fact: how far the pull of `image` has come. Each new one is progress; none for a while is a stall."""

    image: str
    layers_done: int
    layers_total: int
    downloaded_bytes: int
    unpacked_bytes: int
    total_bytes: int

    def describe(self) -> str:
        """`pulling nvcr.io/nvidia/vllm:26.05-py3: 4.10 of 9.80 GB downloaded, 3.20 GB unpacked (3 of 12 layers)`, for STATUS=."""
        text = f"pulling {self.image}"
        if not self.layers_total:
            return text
        layers = f"{self.layers_done} of {self.layers_total} layers"
        if not self.total_bytes:
            return f"{text}: {layers}"
        gb = 1e9
        return (f"{text}: {self.downloaded_bytes / gb:.2f} of {self.total_bytes / gb:.2f} GB downloaded, "
                f"{self.unpacked_bytes / gb:.2f} GB unpacked ({layers})")


@dataclass(frozen=True)
class PullState:
    """What the pull output said so far, layer by layer."""

    image: str
    layers: Mapping[str, Layer] = field(default_factory=dict)

    def progress(self) -> PullProgress:
        """The state summed up as one fact."""
        layers = list(self.layers.values())
        return PullProgress(
            image=self.image,
            layers_done=sum(layer.complete for layer in layers),
            layers_total=len(layers),
            downloaded_bytes=sum(layer.downloaded_bytes for layer in layers),
            unpacked_bytes=sum(layer.unpacked_bytes for layer in layers),
            total_bytes=sum(layer.total_bytes for layer in layers),
        )


def pull_lines(text: str) -> list[str]:
    """Terminal output as lines: split at `\\r` and `\\n`, cursor movements and colours removed, blanks dropped."""
    return [line.strip() for line in re.split(r"[\r\n]+", _ANSI.sub("", text)) if line.strip()]


def advance_pull(state: PullState, line: str) -> PullState:
    """The state after one line of `docker pull` or `podman pull` output; the same state for lines that say nothing new."""
    docker = _DOCKER_LAYER.fullmatch(line)
    if docker is not None:
        return _with_layer(state, docker["id"][:12], _docker_layer(state.layers.get(docker["id"][:12], Layer()), docker["status"], docker["sizes"] or ""))
    podman = _PODMAN_BLOB.fullmatch(line)
    if podman is not None:
        layer = state.layers.get(podman["id"][:12], Layer())
        rest = podman["rest"].strip()
        sizes = _sizes(rest)
        if rest.startswith(("done", "skipped")):
            # podman writes each blob into storage as it downloads it: a blob done is a layer unpacked.
            layer = replace(layer, phase="complete", downloaded_bytes=layer.total_bytes, unpacked_bytes=layer.total_bytes)
        elif sizes is not None:
            layer = replace(layer, phase="downloading", downloaded_bytes=sizes[0], total_bytes=sizes[1])
        return _with_layer(state, podman["id"][:12], layer)
    return state


def _docker_layer(layer: Layer, status: str, sizes_text: str) -> Layer:
    """One layer after a docker status line (`Downloading 1MB/2MB`, `Extracting ...`, `Pull complete`)."""
    sizes = _sizes(sizes_text)
    if status in ("Pull complete", "Already exists"):
        return replace(layer, phase="complete", downloaded_bytes=layer.total_bytes, unpacked_bytes=layer.total_bytes)
    if status == "Downloading" and sizes is not None:
        return replace(layer, phase="downloading", downloaded_bytes=sizes[0], total_bytes=sizes[1])
    if status == "Extracting" and sizes is not None:
        # The extraction counts through the same compressed bytes that were downloaded.
        return replace(layer, phase="unpacking", downloaded_bytes=max(layer.total_bytes, sizes[1]), unpacked_bytes=sizes[0], total_bytes=max(layer.total_bytes, sizes[1]))
    if status in ("Verifying Checksum", "Download complete"):
        return replace(layer, phase="verifying", downloaded_bytes=layer.total_bytes)
    return layer


def _with_layer(state: PullState, layer_id: str, layer: Layer) -> PullState:
    if state.layers.get(layer_id) == layer:
        return state
    return replace(state, layers={**state.layers, layer_id: layer})


# --- why a pull failed -------------------------------------------------------------------------------

PullFailureKind = Literal["not_found", "unauthorized", "unreachable", "insecure", "disk_full", "not_present", "other"]

_FAILURE_PATTERNS: list[tuple[PullFailureKind, re.Pattern[str]]] = [
    ("unauthorized", re.compile(r"unauthorized|authentication required|no basic auth credentials|requested access to the resource is denied|denied:|401 Unauthorized|403 Forbidden", re.I)),
    ("not_found", re.compile(r"manifest unknown|manifest for .* not found|not found: manifest|name unknown|repository .* not found|does not exist|reading manifest .* not found|404 Not Found", re.I)),
    ("insecure", re.compile(r"server gave HTTP response to HTTPS client|x509:|certificate|tls: ", re.I)),
    ("unreachable", re.compile(r"connection refused|no such host|i/o timeout|network is unreachable|TLS handshake timeout|"
                               r"dial tcp|temporary failure in name resolution|context deadline exceeded|connection reset|no route to host", re.I)),
    ("disk_full", re.compile(r"no space left on device", re.I)),
]


class PullFailed(Gb10dError):
    """The image could not be pulled; retrying at once would fail the same way."""

    # gb10d does not pull again in a loop: the operator has to fix the reference, the credentials
    # or the network. Exit 78 stops systemd's restarts too; 75 lets them try later, within the unit's limits.
    retry_worthy = False

    def __init__(self, kind: PullFailureKind, message: str) -> None:
        self.kind = kind
        self.exit_status = EXIT_GAVE_UP if kind in ("unreachable", "disk_full", "other") else EXIT_CONFIG
        super().__init__(message)


def pull_failure(engine: str, image: str, output: str, status: int) -> PullFailed:
    """Why `ENGINE pull IMAGE` failed and what to do, from its output and exit status."""
    lines = pull_lines(output)
    said = next((line for line in reversed(lines) if re.search(r"error|denied|unauthorized|not found|refused", line, re.I)), lines[-1] if lines else f"exit status {status}")
    said = re.sub(r"^(?:Error(?: response from daemon)?|docker|podman):\s*", "", said)
    kind: PullFailureKind = next((k for k, pattern in _FAILURE_PATTERNS if pattern.search(output)), "other")
    ref = parse_reference(image)
    registry = ref.domain or "docker.io"
    advice = {
        "unauthorized": f"the registry {registry} refused the credentials of the user running gb10d; log in as that user "
        f"(sudo -u gb10d {engine} login {registry}) or check that vllm.image is spelled right",
        "not_found": f"{registry} has no image {image}; check the repository and tag of vllm.image "
        f"({engine} search or the registry's catalogue lists the tags)",
        "insecure": f"{engine} refused the connection to {registry} as insecure; give the registry a valid TLS certificate, "
        "or list it as an insecure registry (docker: /etc/docker/daemon.json; podman: /etc/containers/registries.conf)",
        "unreachable": f"{registry} cannot be reached from this machine; check the network and proxy settings of {engine}, "
        f"or pull the image by other means and set container.pull = \"never\"",
        "disk_full": f"the disk holding {engine}'s images is full; free space ({engine} image prune) and start again",
        "other": f"see the engine's message; try by hand: {engine} pull {image}",
    }.get(kind, "")
    return PullFailed(kind, f"cannot pull {image}: {said}; {advice}")


def not_present(engine: str, image: str) -> PullFailed:
    """The image is missing and container.pull = "never" forbids fetching it."""
    return PullFailed(
        "not_present",
        f"the image {image} is not present in {engine} and container.pull is \"never\"; "
        f"load it ({engine} pull {image}, or {engine} load -i FILE) or set container.pull = \"missing\"",
    )


# --- which image was started ---------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    """The local image a reference resolved to: its id and, when it came from a registry, its repository digest."""

    reference: str
    image_id: str
    repo_digest: str | None

    @property
    def identity(self) -> str:
        """What learned settings are keyed by: the registry digest when there is one, else the local id."""
        return self.repo_digest or self.image_id

    def describe(self) -> str:
        """`nvcr.io/nvidia/vllm:26.05-py3 (sha256:ab12...)`, for the journal."""
        return f"{self.reference} ({self.identity})"


def image_info(reference: str, image_id: str, repo_digests: list[str], digest: str | None = None) -> ImageInfo:
    """The ImageInfo of `image inspect` output; the repository digest is the one of the reference's repository."""
    ref = parse_reference(reference)
    wanted = {ref.repository, ref.path, f"docker.io/{ref.path}", f"docker.io/library/{ref.path}", f"library/{ref.path}"}
    found = next((d.partition("@")[2] for d in repo_digests if d.partition("@")[0] in wanted), None)
    if found is None and digest:
        found = digest
    if found is None and ref.digest:
        found = ref.digest
    return ImageInfo(reference, image_id if image_id.startswith("sha256:") else f"sha256:{image_id}", found)


@dataclass(frozen=True)
class PreparedImage:
    """The image an attempt will start: what it is, whether gb10d just pulled it, what the tag named before, and
    the container it runs as (its name and engine, once the launcher says)."""

    info: ImageInfo
    pulled: bool
    previous: ImageInfo | None
    container: str = ""
    engine: str = ""

    @property
    def moved(self) -> str | None:
        """The journal line when the pull moved the tag to another image, else None."""
        return digest_change(self.previous, self.info)


def digest_change(before: ImageInfo | None, after: ImageInfo) -> str | None:
    """A journal line when a tag now points to another image than the one started before; None when it did not move."""
    if before is None or before.identity == after.identity:
        return None
    return (
        f"the tag {after.reference} now points to another image: {after.identity} (was {before.identity}); "
        "settings learned with the old image are not applied until this one has started"
    )
