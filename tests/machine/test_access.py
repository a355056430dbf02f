"""Who may reach a path: the kernel's rules as a pure function of stat data, and the ways out of a denial.

The table tests state the rules; the last test holds the decision against
the real kernel, with a child process that has really become another user.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gb10d.machine.access import (
    ACL_GROUP,
    ACL_GROUP_OBJ,
    ACL_MASK,
    ACL_OTHER,
    ACL_USER,
    ACL_USER_OBJ,
    AclEntry,
    Node,
    Principal,
    Want,
    parse_acl,
    permits,
    reach,
    walk,
    ways_out,
)

DIR, FILE = stat.S_IFDIR, stat.S_IFREG
ALICE = Principal("alice", 1000, frozenset({1000}))
GB10D = Principal("gb10d", 998, frozenset({998}))
GB10D_IN_ALICE = Principal("gb10d", 998, frozenset({998, 1000}))
ROOT = Principal("root", 0, frozenset({0}))


def node(path: str, mode: int, uid: int = 1000, gid: int = 1000, kind: int = DIR, acl: tuple[AclEntry, ...] = ()) -> Node:
    names = {0: "root", 1000: "alice", 998: "gb10d"}
    return Node(path, uid, gid, kind | mode, names.get(uid, str(uid)), names.get(gid, str(gid)), acl)


def acl(*entries: tuple[int, int, int | None]) -> tuple[AclEntry, ...]:
    return tuple(AclEntry(tag, perm, qualifier) for tag, perm, qualifier in entries)


@pytest.mark.parametrize(
    ("target", "who", "want", "allowed"),
    [
        (node("/home/alice", 0o750), GB10D, Want.EXEC, False),  # Ubuntu 24.04's home: others may not enter
        (node("/home/alice", 0o750), GB10D_IN_ALICE, Want.EXEC, True),  # ...members of its group may
        (node("/home/alice", 0o750), ALICE, Want.EXEC, True),
        (node("/home/alice", 0o755), GB10D, Want.EXEC, True),  # Ubuntu before 21.04, Debian
        (node("/home/alice", 0o700), GB10D_IN_ALICE, Want.EXEC, False),
        (node("/home/alice", 0o570), ALICE, Want.WRITE, False),  # the owner's bits count, not the group's
        (node("/home/alice", 0o700), ROOT, Want.EXEC, True),  # root enters anything
        (node("/opt/vllm", 0o644, 0, 0, FILE), ROOT, Want.EXEC, False),  # but runs only what someone may run
        (node("/opt/vllm", 0o744, 0, 0, FILE), ROOT, Want.EXEC, True),
        (node("/opt/vllm", 0o755, 0, 0, FILE), GB10D, Want.EXEC | Want.READ, True),
        (node("/srv/secrets.env", 0o640, 0, 998, FILE), GB10D, Want.READ, True),
        (node("/srv/secrets.env", 0o600, 0, 998, FILE), GB10D, Want.READ, False),
        # POSIX ACLs: a named user entry, limited by the mask; groups, any of which may grant.
        (node("/home/alice", 0o710, acl=acl((ACL_USER_OBJ, 7, None), (ACL_USER, 1, 998), (ACL_GROUP_OBJ, 0, None), (ACL_MASK, 1, None), (ACL_OTHER, 0, None))), GB10D, Want.EXEC, True),
        (node("/home/alice", 0o700, acl=acl((ACL_USER_OBJ, 7, None), (ACL_USER, 7, 998), (ACL_GROUP_OBJ, 0, None), (ACL_MASK, 0, None), (ACL_OTHER, 0, None))), GB10D, Want.EXEC, False),
        (node("/home/alice", 0o750, acl=acl((ACL_USER_OBJ, 7, None), (ACL_GROUP_OBJ, 0, None), (ACL_GROUP, 5, 998), (ACL_MASK, 5, None), (ACL_OTHER, 0, None))), GB10D, Want.EXEC, True),
        # A user that matches a group entry which does not grant is denied, even if "other" would grant.
        (node("/srv/x", 0o705, 0, 998, acl=acl((ACL_USER_OBJ, 7, None), (ACL_GROUP_OBJ, 0, None), (ACL_MASK, 7, None), (ACL_OTHER, 5, None))), GB10D, Want.EXEC, False),
    ],
)
def test_permission_follows_the_kernels_rules(target: Node, who: Principal, want: Want, allowed: bool) -> None:
    assert permits(target, who, want) is allowed


def test_the_first_directory_in_the_way_is_the_one_named() -> None:
    chain = [node("/", 0o755, 0, 0), node("/home", 0o755, 0, 0), node("/home/alice", 0o750), node("/home/alice/.cache", 0o700),
             node("/home/alice/.cache/vllm", 0o755)]
    denial = reach(chain, GB10D, Want.WRITE)
    assert denial is not None and denial.node.path == "/home/alice"
    assert denial.cause() == "/home/alice is mode 0750 and the service user gb10d may not enter it"
    inside = reach(chain, GB10D_IN_ALICE, Want.WRITE)
    assert inside is not None and inside.cause() == "/home/alice/.cache is mode 0700 and the service user gb10d may not enter it"
    assert reach(chain, ALICE, Want.WRITE) is None


@pytest.mark.parametrize(
    ("target", "want", "verb"),
    [
        (node("/m", 0o700), Want.READ, "enter"),  # not even allowed in: that comes first
        (node("/m", 0o701), Want.READ, "list"),
        (node("/m", 0o705), Want.WRITE, "write in"),
        (node("/m/config.json", 0o600, kind=FILE), Want.READ, "read"),
        (node("/v/bin/vllm", 0o700, kind=FILE), Want.EXEC, "run"),
    ],
)
def test_a_denial_says_what_may_not_be_done(target: Node, want: Want, verb: str) -> None:
    denial = reach([node("/", 0o755, 0, 0), target], GB10D, want)
    assert denial is not None and denial.cause().endswith(f"may not {verb} it")


def test_a_home_in_the_way_has_two_ways_out_as_exact_commands() -> None:
    denial = reach([node("/", 0o755, 0, 0), node("/home/alice", 0o750)], GB10D, Want.EXEC)
    assert denial is not None
    assert [w.command for w in ways_out(denial, "gb10d.service")] == ["sudo gb10d service-user alice", "sudo usermod -aG alice gb10d"]
    assert [w.command for w in ways_out(denial, "gb10d@second.service")][0] == "sudo gb10d service-user alice --unit gb10d@second"


def test_a_group_without_the_bit_gets_it_added_before_the_service_user_joins() -> None:
    denial = reach([node("/", 0o755, 0, 0), node("/home/alice", 0o700)], GB10D, Want.EXEC)
    assert denial is not None
    assert ways_out(denial, "gb10d.service")[1].command == "sudo chmod g+x /home/alice && sudo usermod -aG alice gb10d"


def test_a_system_directory_is_never_made_world_writable() -> None:
    readable = reach([node("/", 0o755, 0, 0), node("/opt/models", 0o700, 0, 0)], GB10D, Want.READ)
    writable = reach([node("/", 0o755, 0, 0), node("/var/cache", 0o755, 0, 0)], GB10D, Want.WRITE)
    assert readable is not None and [w.command for w in ways_out(readable, "gb10d.service")] == ["sudo chmod o+rx /opt/models"]
    assert writable is not None and ways_out(writable, "gb10d.service") == []


def test_acl_attribute_is_parsed_from_its_binary_form() -> None:
    raw = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, qualifier)
        for tag, perm, qualifier in ((ACL_USER_OBJ, 7, 0xFFFFFFFF), (ACL_USER, 1, 998), (ACL_GROUP_OBJ, 5, 0xFFFFFFFF), (ACL_MASK, 5, 0xFFFFFFFF), (ACL_OTHER, 0, 0xFFFFFFFF))
    )
    assert parse_acl(raw) == acl((ACL_USER_OBJ, 7, None), (ACL_USER, 1, 998), (ACL_GROUP_OBJ, 5, None), (ACL_MASK, 5, None), (ACL_OTHER, 0, None))
    assert parse_acl(b"junk") == ()


# --- against the real kernel ------------------------------------------------------

NOBODY = 65534
GROUP = 4242  # a group the test user holds besides its own
PROBE = """
import json, os, sys
results = []
for path, want, is_dir in json.loads(sys.argv[1]):
    try:
        if want == "enter":
            os.stat(os.path.join(path, "."))
        elif want == "list":
            os.listdir(path)
        elif want == "read":
            open(path, "rb").close()
        elif want == "run":
            if not os.access(path, os.X_OK):
                raise PermissionError
        elif want == "write":
            probe = os.path.join(path, ".probe")
            open(probe, "w").close()
            os.unlink(probe)
        results.append(True)
    except PermissionError:
        results.append(False)
print(json.dumps(results))
"""
WANTS = {"enter": Want.EXEC, "list": Want.READ, "read": Want.READ, "run": Want.EXEC, "write": Want.WRITE}


def _acl_bytes(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


@pytest.fixture
def tree() -> Iterator[Path]:
    """Directories and files of several owners and modes, under a directory every user may enter."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files to other users and to become another user")
    base = Path(tempfile.mkdtemp(prefix="gb10d-access-", dir="/tmp"))
    base.chmod(0o755)
    layout = [
        ("home", 0o750, 1000, 1000, True), ("home/venv", 0o755, 1000, 1000, True), ("home/venv/vllm", 0o755, 1000, 1000, False),
        ("shared", 0o750, 0, GROUP, True), ("shared/secrets.env", 0o640, 0, GROUP, False), ("shared/own.env", 0o600, 0, GROUP, False),
        ("private", 0o700, 0, 0, True), ("private/file", 0o644, 0, 0, False),
        ("acl", 0o700, 1000, 1000, True), ("acl/file", 0o644, 1000, 1000, False),
        ("masked", 0o700, 1000, 1000, True),
        ("open", 0o755, 0, 0, True), ("open/noexec", 0o644, 0, 0, False), ("open/run", 0o711, 0, 0, False),
        ("writable", 0o775, 0, GROUP, True), ("sticky", 0o755, 0, 0, True),
    ]
    for name, mode, uid, gid, is_dir in layout:
        path = base / name
        path.mkdir() if is_dir else path.write_text("x")
        os.chown(path, uid, gid)
        path.chmod(mode)
    try:
        os.setxattr(base / "acl", "system.posix_acl_access", _acl_bytes((ACL_USER_OBJ, 7, 0), (ACL_USER, 1, NOBODY), (ACL_GROUP_OBJ, 0, 0), (ACL_MASK, 1, 0), (ACL_OTHER, 0, 0)))
        os.setxattr(base / "masked", "system.posix_acl_access", _acl_bytes((ACL_USER_OBJ, 7, 0), (ACL_USER, 7, NOBODY), (ACL_GROUP_OBJ, 0, 0), (ACL_MASK, 0, 0), (ACL_OTHER, 0, 0)))
    except OSError:
        pass  # no POSIX ACLs on this file system: those directories are plain 0700 ones, still compared
    yield base
    shutil.rmtree(base)


@pytest.mark.slow
def test_decisions_match_what_the_kernel_lets_another_user_do(tree: Path) -> None:
    # The system interpreter: one in root's home would be out of the test user's reach.
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("needs a system python3 that any user may run")
    cases = [
        ("home", "enter"), ("home/venv/vllm", "run"), ("home/venv/vllm", "read"), ("shared", "list"), ("shared/secrets.env", "read"),
        ("shared/own.env", "read"), ("private", "enter"), ("private/file", "read"), ("acl", "enter"), ("acl/file", "read"), ("acl", "list"),
        ("masked", "enter"), ("open/noexec", "run"), ("open/run", "run"), ("open/run", "read"), ("writable", "write"), ("sticky", "write"),
    ]
    who = Principal("nobody", NOBODY, frozenset({NOBODY, GROUP}))
    decided = []
    for name, want in cases:
        walked = walk(str(tree / name))
        assert walked.missing is None and walked.hidden is None
        decided.append(reach(walked.chain, who, WANTS[want]) is None)
    probe = json.dumps([[str(tree / name), want, (tree / name).is_dir()] for name, want in cases])
    done = subprocess.run([python, "-I", "-c", PROBE, probe], user=NOBODY, group=NOBODY, extra_groups=[GROUP],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    kernel = json.loads(done.stdout)
    assert dict(zip(cases, decided)) == dict(zip(cases, kernel))
    # The table has both outcomes, so agreement is not a coincidence of "all allowed".
    assert True in kernel and False in kernel


def test_walk_follows_symbolic_links_as_the_kernel_does(tmp_path: Path) -> None:
    (tmp_path / "real" / "bin").mkdir(parents=True)
    (tmp_path / "real" / "bin" / "python3.12").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "bin" / "python3").symlink_to("python3.12")
    walked = walk(str(tmp_path / "link" / "bin" / "python3"))
    assert walked.missing is None
    assert walked.chain[-1].path == str(tmp_path / "real" / "bin" / "python3.12")
    assert walk(str(tmp_path / "nothing" / "here")).missing == str(tmp_path / "nothing")


def test_roots_home_in_the_way_offers_a_venv_outside_it_or_a_login_user_before_opening_it() -> None:
    denial = reach([node("/", 0o755, 0, 0), node("/root", 0o700, 0, 0), node("/root/venv", 0o755, 0, 0)], GB10D, Want.EXEC)
    assert denial is not None and denial.node.path == "/root"
    assert [w.command for w in ways_out(denial, "gb10d.service")] == [
        "sudo python3 -m venv /opt/vllm-venv && sudo /opt/vllm-venv/bin/pip install vllm",
        "sudo gb10d service-user NAME",
        "sudo chmod o+x /root",
    ]
