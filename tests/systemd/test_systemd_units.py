"""The unit files as written in units/: hardening score, the template kept in step, the front's socket and stop timeout."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from systemd_harness import REPO

UNITS = REPO / "units"
# [front] drain_timeout_s's default: how long the front finishes its requests after SIGTERM.
FRONT_DRAIN_S = 30

# What gb10d@.service may do differently from gb10d.service, and nothing else.
INSTANCE_ONLY = {
    ("Unit", "Description", "gb10d vLLM supervisor for %i"),
    ("Service", "Environment", "GB10D_CONFIG=/etc/gb10d/%i.toml"),
    ("Service", "StateDirectory", "gb10d/%i"),
    ("Service", "RuntimeDirectory", "gb10d-%i"),
}
MAIN_ONLY = {
    ("Unit", "Description", "gb10d vLLM supervisor"),
    ("Service", "StateDirectory", "gb10d"),
    ("Service", "RuntimeDirectory", "gb10d"),
}


def settings(name: str) -> set[tuple[str, str, str]]:
    """(section, key, value) of every assignment in a unit file; keys may repeat, as systemd allows."""
    section = ""
    found: set[tuple[str, str, str]] = set()
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.add((section, key, value))
    return found


def test_template_unit_differs_from_the_main_unit_only_in_its_instance_settings() -> None:
    main, template = settings("gb10d.service"), settings("gb10d@.service")
    assert template - main == INSTANCE_ONLY
    assert main - template == MAIN_ONLY


def test_units_restart_on_failure_except_for_config_errors() -> None:
    for name in ("gb10d.service", "gb10d@.service"):
        unit = settings(name)
        assert ("Service", "Restart", "on-failure") in unit
        assert ("Service", "RestartPreventExitStatus", "78") in unit
        # The start limit only works in [Unit]; in [Service] systemd ignores it with a warning.
        assert {key for section, key, _ in unit if key.startswith("StartLimit")} == {"StartLimitIntervalSec", "StartLimitBurst"}
        assert all(section == "Unit" for section, key, _ in unit if key.startswith("StartLimit"))


def test_the_front_listens_on_its_socket_and_systemd_waits_out_its_drain() -> None:
    socket_unit, service = settings("gb10d-front.socket"), settings("gb10d-front.service")
    assert {("Socket", "ListenStream", "8000"), ("Socket", "FileDescriptorName", "front")} <= socket_unit
    # Requires= alone would start both at once: a front starting before its socket exists would bind [front] listen.
    assert {("Unit", "Requires", "gb10d-front.socket"), ("Unit", "After", "gb10d-front.socket")} <= service
    assert ("Install", "Also", "gb10d-front.socket") in service, "enabling the front must enable its port"
    assert ("Service", "ExecReload", "/bin/kill -HUP $MAINPID") in service
    stop_timeout_s = {key: value for section, key, value in service if section == "Service"}["TimeoutStopSec"]
    assert int(stop_timeout_s) > FRONT_DRAIN_S, "systemd would SIGKILL the front in the middle of its drain"


@pytest.mark.parametrize("name", ["gb10d.service", "gb10d@.service", "gb10d-front.service"])
def test_hardening_scores_4_or_better(name: str) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("needs systemd-analyze (apt-get install systemd)")
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNITS / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    if match is None and "offline" in result.stderr:
        pytest.skip(f"this systemd-analyze has no --offline (needs systemd 250+): {result.stderr.strip()}")
    assert match is not None, result.stdout + result.stderr
    assert float(match.group(1)) <= 4.0, result.stdout
