"""The unit as the service meets it (user, environment, sandbox), logind's RemoveIPC=, and the user drop-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.machine.access import Principal
from gb10d.machine.service import (
    Sandbox,
    context_from_show,
    ipc_warning,
    parse_environment,
    parse_show,
    remove_ipc,
    sandbox_of,
    unit_for_config,
    user_dropin,
)

ALICE = Principal("alice", 1000, frozenset({1000}))
GB10D = Principal("gb10d", 998, frozenset({998}))

SHOW = """LoadState=loaded
User=gb10d
Group=gb10d
SupplementaryGroups=
Environment=HF_HOME=/var/cache/gb10d/huggingface VLLM_CACHE_ROOT=/var/cache/gb10d/vllm "NOTE=two words"
UnsetEnvironment=VLLM_CACHE_ROOT
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths=-/home/alice/.cache /srv/models
PrivateTmp=yes
StateDirectory=gb10d
CacheDirectory=gb10d
RuntimeDirectory=gb10d
"""


def test_the_units_environment_less_what_it_unsets_is_the_services() -> None:
    context = context_from_show("gb10d.service", parse_show(SHOW), GB10D)
    assert context is not None
    assert context.environment == {"HF_HOME": "/var/cache/gb10d/huggingface", "NOTE": "two words"}
    assert context.source == "the user gb10d.service runs as"


def test_a_unit_systemd_does_not_know_gives_no_context() -> None:
    assert context_from_show("gb10d.service", {"LoadState": "not-found"}, GB10D) is None


@pytest.mark.parametrize(
    ("path", "writable"),
    [
        ("/var/cache/gb10d/vllm", True),  # CacheDirectory=: systemd makes it the service user's
        ("/var/lib/gb10d/state.toml", True),
        ("/home/alice/.cache/vllm", True),  # ReadWritePaths= opens it inside the read-only home
        ("/home/alice/.triton", False),  # ProtectHome=read-only
        ("/srv/models/x", True),
        ("/srv/other", False),  # ProtectSystem=strict
        ("/tmp/torchinductor_gb10d", True),  # PrivateTmp=
        ("/etc/gb10d.toml", False),
    ],
)
def test_the_sandbox_decides_where_the_service_may_write(path: str, writable: bool) -> None:
    assert sandbox_of(parse_show(SHOW)).allows_write(path) is writable


def test_protect_home_yes_hides_the_homes_and_read_only_does_not() -> None:
    assert not Sandbox(protect_home="yes").allows_read("/home/alice/venv")
    assert Sandbox(protect_home="read-only").allows_read("/home/alice/venv")
    assert Sandbox(protect_home="read-only").why_read_only("/home/alice/.cache") == "ProtectHome=read-only"


def test_environment_values_keep_their_quoted_spaces() -> None:
    assert parse_environment('A=1 "B=two words" C=') == {"A": "1", "B": "two words", "C": ""}


@pytest.mark.parametrize(
    ("texts", "removes"),
    [
        ([], True),  # logind's default
        (["[Login]\n#RemoveIPC=yes\n"], True),  # Debian's and Ubuntu's logind.conf: all commented out
        (["[Login]\nRemoveIPC=no\n"], False),
        (["[Login]\nRemoveIPC=no\n", "[Login]\nRemoveIPC=yes\n"], True),  # a later drop-in wins
        (["[Other]\nRemoveIPC=no\n"], True),
    ],
)
def test_remove_ipc_is_read_as_logind_reads_it(texts: list[str], removes: bool) -> None:
    assert remove_ipc(texts) is removes


def test_a_login_user_without_lingering_gets_the_remove_ipc_warning() -> None:
    warning = ipc_warning(ALICE, removes_ipc=True, lingers=False, unit="gb10d.service")
    assert warning is not None and "SemLock._rebuild" in warning and warning.endswith("sudo loginctl enable-linger alice")
    assert ipc_warning(ALICE, removes_ipc=True, lingers=True, unit="gb10d.service") is None
    assert ipc_warning(ALICE, removes_ipc=False, lingers=False, unit="gb10d.service") is None
    assert ipc_warning(GB10D, removes_ipc=True, lingers=False, unit="gb10d.service") is None  # a system user's IPC is never removed


def test_the_user_drop_in_keeps_the_hardening_and_opens_only_the_cache_directories() -> None:
    text = user_dropin("alice", "alice", "/home/alice")
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert settings == [
        "[Service]",
        "User=alice",
        "Group=alice",
        "UnsetEnvironment=HF_HOME VLLM_CACHE_ROOT TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR CUDA_CACHE_PATH XDG_CACHE_HOME",
        "ReadWritePaths=-/home/alice/.cache -/home/alice/.triton -/home/alice/.nv",
        # Added to the unit's own groups: the memory ledger the instances share is the gb10d group's.
        "SupplementaryGroups=gb10d",
    ]


@pytest.mark.parametrize(
    ("config", "unit"),
    [("/etc/gb10d.toml", "gb10d.service"), ("/etc/gb10d/second.toml", "gb10d@second.service"), ("/srv/x.toml", "gb10d.service")],
)
def test_the_unit_is_the_one_that_reads_the_config(config: str, unit: str) -> None:
    assert unit_for_config(Path(config)) == unit
