"""Container images as gb10d judges them: references, pull progress, pull failures, and which image was started.

Plain functions over the texts docker and podman print; the pull outputs
are the engines' own terminal output as recorded on a test machine.
"""

from __future__ import annotations

import pytest

from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP
from gb10d.base.image import ImageInfo, PullState, advance_pull, digest_change, image_info, parse_reference, pull_failure, pull_lines

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "domain", "path", "tag", "digest"),
    [
        ("nvcr.io/nvidia/vllm:26.05-py3", "nvcr.io", "nvidia/vllm", "26.05-py3", None),
        ("vllm/vllm-openai", None, "vllm/vllm-openai", None, None),
        ("ubuntu", None, "ubuntu", None, None),
        ("localhost:5000/gb10d/sim:1", "localhost:5000", "gb10d/sim", "1", None),
        ("localhost/gb10d-test/sim:abc", "localhost", "gb10d-test/sim", "abc", None),
        (f"nvcr.io/nvidia/vllm@{DIGEST}", "nvcr.io", "nvidia/vllm", None, DIGEST),
        (f"nvcr.io/nvidia/vllm:26.05-py3@{DIGEST}", "nvcr.io", "nvidia/vllm", "26.05-py3", DIGEST),
        ("ghcr.io/some_org/spark-vllm:nightly-2026.12.01", "ghcr.io", "some_org/spark-vllm", "nightly-2026.12.01", None),
    ],
)
def test_image_references_are_read_as_the_engines_read_them(text: str, domain: str | None, path: str, tag: str | None, digest: str | None) -> None:
    ref = parse_reference(text)
    assert (ref.domain, ref.path, ref.tag, ref.digest) == (domain, path, tag, digest)
    assert ref.moves == (digest is None)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "must name a container image"),
        ("nvcr.io/NVIDIA/vllm:26.05-py3", "the repository name must be lowercase"),
        ("nvcr.io/nvidia/vllm:26.05 py3", "it contains blanks"),
        (" nvcr.io/nvidia/vllm", "it contains blanks"),
        ("https://nvcr.io/nvidia/vllm", "not a URL: drop the scheme"),
        ("nvcr.io/nvidia/vllm::1", "it must be [REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST]"),
        ("nvcr.io/nvidia/vllm:-x", "it must be [REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST]"),
        ("nvcr.io/nvidia/vllm@sha256:12", "it must be [REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST]"),
        ("a" * 260, "longer than 255 characters"),
    ],
)
def test_malformed_references_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError) as bad:
        parse_reference(text)
    assert says in str(bad.value)


# `docker pull` on a 200-column terminal (the bar drawn), and on a narrow one, as recorded.
DOCKER_WIDE = (
    "1: Pulling from gb10d/big\r\n\r\n\x1b[1A\x1b[2K\raac5b88e52fe: Pulling fs layer \r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Downloading [>                                                  ]    553kB/300.1MB\r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Downloading [====>                                              ]  29.18MB/300.1MB\r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Verifying Checksum \r\x1b[1B\x1b[1A\x1b[2K\raac5b88e52fe: Download complete \r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Extracting [>                                                  ]  557.1kB/300.1MB\r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Extracting [==================================================>]  300.1MB/300.1MB\r\x1b[1B"
    "\x1b[1A\x1b[2K\raac5b88e52fe: Pull complete \r\x1b[1BDigest: sha256:f6260efc746c5485106406fba495c5da2d2fdea8e42045000fceb08ca0a8a72a\r\n"
    "Status: Downloaded newer image for 127.0.0.1:5055/gb10d/big:1\r\n127.0.0.1:5055/gb10d/big:1\r\n"
)
DOCKER_NARROW = "aac5b88e52fe: Downloading  18.71MB/300.1MB\r\naac5b88e52fe: Downloading    236MB/300.1MB\r\n"
PODMAN = (
    "Trying to pull 127.0.0.1:5055/gb10d/big:1...\r\nGetting image source signatures\r\n"
    "Copying blob aac5b88e52fe [==>-----------------------------------] 21.0MiB / 286.2MiB\r\n"
    "\x1b[1A\x1b[JCopying blob aac5b88e52fe [=================>--------------------] 132.0MiB / 286.2MiB\r\n"
    "\x1b[1A\x1b[JCopying blob aac5b88e52fe done  \r\n\x1b[1A\x1b[JCopying blob aac5b88e52fe done  \r\n"
    "Copying config 70e9b695db [======================================] 895.0b / 895.0b\r\n"
    "Writing manifest to image destination\r\nStoring signatures\r\n70e9b695db9e1cb6af9a17e34fd709d41a0ecb13033487430928f5e0de9e6d94\r\n"
)


def facts(output: str) -> list[tuple[int, int, int, int, int]]:
    """(layers done, layers, downloaded, unpacked, total) after each line that moved the pull."""
    state = PullState("x")
    seen = []
    for line in pull_lines(output):
        after = advance_pull(state, line)
        if after is not state:
            p = after.progress()
            seen.append((p.layers_done, p.layers_total, p.downloaded_bytes, p.unpacked_bytes, p.total_bytes))
        state = after
    return seen


def test_docker_pull_on_a_wide_terminal_reports_bytes_downloaded_then_unpacked() -> None:
    assert facts(DOCKER_WIDE) == [
        (0, 1, 0, 0, 0),
        (0, 1, 553_000, 0, 300_100_000),
        (0, 1, 29_180_000, 0, 300_100_000),
        (0, 1, 300_100_000, 0, 300_100_000),
        (0, 1, 300_100_000, 557_100, 300_100_000),
        (0, 1, 300_100_000, 300_100_000, 300_100_000),
        (1, 1, 300_100_000, 300_100_000, 300_100_000),
    ]


def test_docker_pull_on_a_narrow_terminal_reports_the_same_bytes() -> None:
    assert facts(DOCKER_NARROW) == [(0, 1, 18_710_000, 0, 300_100_000), (0, 1, 236_000_000, 0, 300_100_000)]


def test_podman_pull_reports_bytes_and_a_blob_done_once() -> None:
    mib = 1 << 20
    assert facts(PODMAN) == [
        (0, 1, int(21.0 * mib), 0, int(286.2 * mib)),
        (0, 1, int(132.0 * mib), 0, int(286.2 * mib)),
        (1, 1, int(286.2 * mib), int(286.2 * mib), int(286.2 * mib)),
    ]


def test_a_layer_already_here_counts_as_done() -> None:
    assert facts("1: Pulling from x\naac5b88e52fe: Already exists\n0123456789ab: Pulling fs layer\n") == [(1, 1, 0, 0, 0), (1, 2, 0, 0, 0)]


def test_progress_reads_as_a_status_line() -> None:
    state = PullState("nvcr.io/nvidia/vllm:26.05-py3")
    assert state.progress().describe() == "pulling nvcr.io/nvidia/vllm:26.05-py3"
    for line in ["aac5b88e52fe: Pulling fs layer", "0123456789ab: Downloading  4.1GB/9.8GB", "aac5b88e52fe: Already exists"]:
        state = advance_pull(state, line)
    assert state.progress().describe() == "pulling nvcr.io/nvidia/vllm:26.05-py3: 4.10 of 9.80 GB downloaded, 0.00 GB unpacked (1 of 2 layers)"


NVIDIA = "nvcr.io/nvidia/vllm:26.05-py3"


@pytest.mark.parametrize(
    ("engine", "image", "output", "kind", "status", "advice"),
    [
        ("docker", "127.0.0.1:1/x:1", 'Error response from daemon: Get "http://127.0.0.1:1/v2/": dial tcp 127.0.0.1:1: connect: connection refused',
         "unreachable", EXIT_GAVE_UP, "127.0.0.1:1 cannot be reached from this machine"),
        ("docker", NVIDIA, 'Error response from daemon: Get "https://nvcr.io/v2/": dial tcp: lookup nvcr.io on 127.0.0.53:53: no such host',
         "unreachable", EXIT_GAVE_UP, 'or pull the image by other means and set container.pull = "never"'),
        ("docker", "nvcr.io/nvidia/vllm:99.99-py3", "Error response from daemon: manifest for nvcr.io/nvidia/vllm:99.99-py3 not found: manifest unknown: manifest unknown",
         "not_found", EXIT_CONFIG, "nvcr.io has no image nvcr.io/nvidia/vllm:99.99-py3; check the repository and tag of vllm.image"),
        ("podman", "nvcr.io/nvidia/vllm:99.99-py3", "Trying to pull nvcr.io/nvidia/vllm:99.99-py3...\nError: initializing source docker://nvcr.io/nvidia/vllm:99.99-py3: "
         "reading manifest 99.99-py3 in nvcr.io/nvidia/vllm: manifest unknown", "not_found", EXIT_CONFIG, "check the repository and tag of vllm.image"),
        ("docker", NVIDIA, 'Error response from daemon: Head "https://nvcr.io/v2/nvidia/vllm/manifests/26.05-py3": unauthorized: authentication required',
         "unauthorized", EXIT_CONFIG, "log in as that user (sudo -u gb10d docker login nvcr.io)"),
        ("docker", "127.0.0.1:5000/x:1", 'Error response from daemon: Head "http://127.0.0.1:5000/v2/x/manifests/1": no basic auth credentials',
         "unauthorized", EXIT_CONFIG, "sudo -u gb10d docker login 127.0.0.1:5000"),
        ("podman", "10.0.0.9:5000/x:1", 'Error: initializing source docker://10.0.0.9:5000/x:1: pinging container registry 10.0.0.9:5000: '
         'Get "https://10.0.0.9:5000/v2/": http: server gave HTTP response to HTTPS client', "insecure", EXIT_CONFIG, "/etc/containers/registries.conf"),
        ("docker", NVIDIA, "failed to register layer: write /usr/lib/x: no space left on device", "disk_full", EXIT_GAVE_UP, "docker image prune"),
        ("docker", NVIDIA, "something new went wrong", "other", EXIT_GAVE_UP, f"try by hand: docker pull {NVIDIA}"),
    ],
)
def test_pull_failures_say_what_to_do_and_are_not_retried(engine: str, image: str, output: str, kind: str, status: int, advice: str) -> None:
    failed = pull_failure(engine, image, output, 1)
    assert failed.kind == kind
    assert failed.exit_status == status
    assert failed.retry_worthy is False
    assert str(failed).startswith(f"cannot pull {image}: ")
    assert advice in str(failed)


def test_the_started_image_is_known_by_its_registry_digest_else_by_its_id() -> None:
    pulled = image_info("nvcr.io/nvidia/vllm:26.05-py3", "sha256:" + "11" * 32, ["nvcr.io/nvidia/vllm@" + DIGEST, "other/repo@sha256:" + "22" * 32])
    assert pulled.repo_digest == DIGEST and pulled.identity == DIGEST
    hub = image_info("vllm/vllm-openai:latest", "33" * 32, ["docker.io/vllm/vllm-openai@" + DIGEST])
    assert hub.identity == DIGEST and hub.image_id == "sha256:" + "33" * 32
    built = image_info("localhost/gb10d-test/sim:1", "sha256:" + "44" * 32, [])
    assert built.repo_digest is None and built.identity == "sha256:" + "44" * 32
    assert built.describe() == f"localhost/gb10d-test/sim:1 (sha256:{'44' * 32})"


def test_a_tag_that_points_elsewhere_is_named_with_both_images() -> None:
    before = ImageInfo("nvcr.io/nvidia/vllm:26.05-py3", "sha256:" + "11" * 32, "sha256:" + "aa" * 32)
    after = ImageInfo("nvcr.io/nvidia/vllm:26.05-py3", "sha256:" + "22" * 32, "sha256:" + "bb" * 32)
    assert digest_change(None, after) is None
    assert digest_change(before, before) is None
    assert digest_change(before, after) == (
        f"the tag nvcr.io/nvidia/vllm:26.05-py3 now points to another image: sha256:{'bb' * 32} (was sha256:{'aa' * 32}); "
        "settings learned with the old image are not applied until this one has started"
    )
