"""The .deb files as built by packaging/build-deb: contents, metadata and lintian."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import pytest

from systemd_harness import gb10d_version


class Target(TypedDict):
    """What the package as shipped for one architecture must carry."""

    python: str
    machine: int  # ELF e_machine of the extension modules
    triplet: str
    tag: str


TARGETS: dict[str, Target] = {
    "arm64": {"python": "3.12", "machine": 183, "triplet": "aarch64-linux-gnu", "tag": "cp312-cp312-manylinux2014_aarch64"},
    "amd64": {"python": "3.11", "machine": 62, "triplet": "x86_64-linux-gnu", "tag": "cp311-cp311-manylinux2014_x86_64"},
}
SITE = Path("usr/lib/gb10d/site-packages")


def unpacked(deb: Path, into: Path) -> Path:
    """The package's files, as dpkg would install them, under `into`."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    return into


def field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], check=True, capture_output=True, text=True).stdout.strip()


def elf_machine(path: Path) -> int:
    """e_machine of an ELF file (little-endian, as both targets are)."""
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little")


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_extension_modules_are_built_for_the_target_cpython_and_cpu(
    arch: str, build_deb: Callable[[str, str], Path], tmp_path: Path
) -> None:
    target = TARGETS[arch]
    root = unpacked(build_deb(arch, target["python"]), tmp_path)
    modules = sorted((root / SITE).rglob("*.so"))
    assert modules, "pydantic-core's extension module is missing"
    for module in modules:
        assert f".cpython-{target['python'].replace('.', '')}-{target['triplet']}.so" in module.name, module.name
        assert elf_machine(module) == target["machine"], module
    wheel = next((root / SITE).glob("pydantic_core-*.dist-info")) / "WHEEL"
    assert f"Tag: {target['tag']}" in wheel.read_text()


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_depends_pins_the_python_minor_the_tree_was_built_for(arch: str, build_deb: Callable[[str, str], Path]) -> None:
    minor = TARGETS[arch]["python"]
    deb = build_deb(arch, minor)
    major, number = minor.split(".")
    depends = [d.strip() for d in field(deb, "Depends").split(",")]
    assert f"python3 (>= {minor}~)" in depends and f"python3 (<< {major}.{int(number) + 1})" in depends, depends
    assert "libc6 (>= 2.17)" in depends, depends
    assert "libstdc++6" in depends, "frozenlist's extension module (aiohttp's) links libstdc++"
    assert field(deb, "Architecture") == arch
    assert field(deb, "Version") == gb10d_version()


def test_package_ships_config_units_manual_catalog_and_docs_but_no_bytecode(
    build_deb: Callable[[str, str], Path], tmp_path: Path
) -> None:
    deb = build_deb("amd64", TARGETS["amd64"]["python"])
    root = unpacked(deb, tmp_path / "root")
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    assert (control / "conffiles").read_text().split() == ["/etc/gb10d.toml"]
    expected = [
        "usr/bin/gb10d",
        "usr/share/man/man8/gb10d.8.gz",
        "usr/lib/systemd/catalog/gb10d.catalog",
        "usr/lib/sysusers.d/gb10d.conf",
        "usr/lib/tmpfiles.d/gb10d.conf",
        "usr/share/doc/gb10d/changelog.gz",
        "usr/share/doc/gb10d/copyright",
        "usr/share/doc/gb10d/examples/gb10d.toml",
        "usr/share/gb10d/grafana/gb10d.json",
        "usr/share/gb10d/prometheus/gb10d-alerts.yml",
    ]
    assert [path for path in expected if not (root / path).exists()] == []
    assert list((root / "usr/share/doc/gb10d").glob("README.md*")), "README.md (compressed when large)"
    # Debian 12's debhelper installs units in /lib, newer ones in /usr/lib.
    for unit in ("gb10d.service", "gb10d@.service", "gb10d-front.service", "gb10d-front.socket"):
        assert (root / "lib/systemd/system" / unit).exists() or (root / "usr/lib/systemd/system" / unit).exists(), unit
    tree = root / SITE
    assert not list(tree.rglob("__pycache__")) and not list(tree.rglob("*.pyc"))
    # Vendored files are imported, never run: no exec bits, no #! lines naming the build machine.
    assert [p for p in tree.rglob("*") if p.is_file() and p.stat().st_mode & 0o111] == []
    assert [p for p in tree.rglob("*.py") if p.read_bytes().startswith(b"#!")] == []
    assert (root / "usr/bin/gb10d").read_text().startswith("#!/usr/bin/python3 -I\n")


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_lintian_reports_no_errors_and_no_warnings(arch: str, build_deb: Callable[[str, str], Path]) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("needs lintian (apt-get install lintian; .ci/run installs it)")
    result = subprocess.run(
        ["lintian", "-EvIL", "+pedantic", "--tag-display-limit", "0", str(build_deb(arch, TARGETS[arch]["python"]))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tags = [line for line in result.stdout.splitlines() if line[:2] in ("E:", "W:")]
    assert tags == [], result.stdout
