"""Whether a user may reach a path, decided from stat data the way the kernel decides it.

The service runs as a user (`gb10d`, or the operator's own after
`gb10d service-user`) that is usually not the one who installed vLLM and
downloaded the model. Ubuntu 24.04 creates home directories with mode 0750,
so a venv in `/home/alice` exists but `gb10d` may not enter it; an `is_file()`
made as gb10d only sees "no such file". To name the real cause, gb10d
(usually run as root) collects what `lstat` says about every directory on
the way to a path (`walk`), and `reach` applies the kernel's rules for
another user to it: search (x) on each directory, then the access wanted on
the target; the owner's bits for the owner, else POSIX ACL entries (named
users, then the groups, all limited by the mask), else the group's bits for
a member of the file's group, else the others' bits. Root may do anything
but run a file that no one may run.

Deciding from stat data rather than trying as that user (a child that
drops privileges) keeps the decision pure and table-tested, works for a
user that cannot log in, and tells which directory is in the way, which
is the part of the message the operator acts on. tests/machine/test_access.py
checks it against the real kernel too.

Only the directory in the way and its mode are used for the message and
for the ways out (`ways_out`): run the service as the directory's owner,
or let the service user in through the directory's group.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import struct
from dataclasses import dataclass
from enum import IntFlag
from pathlib import PurePosixPath

# Regular users start here on Debian and Ubuntu (login.defs UID_MIN); logind treats
# uids up to 999 as system users, whose IPC it never removes.
FIRST_REGULAR_UID = 1000
NOBODY_UID = 65534
_MAX_LINKS = 40  # Linux follows at most 40 symbolic links in one lookup (ELOOP)


class Want(IntFlag):
    """The access wanted of the last path component."""

    EXEC = 1
    WRITE = 2
    READ = 4


# Tags of the system.posix_acl_access extended attribute (linux/posix_acl_xattr.h).
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_VERSION = 2


@dataclass(frozen=True)
class AclEntry:
    """One entry of a POSIX access ACL: a tag, its rwx bits, and the uid or gid it names (ACL_USER, ACL_GROUP)."""

    tag: int
    perm: int
    qualifier: int | None = None


def parse_acl(raw: bytes) -> tuple[AclEntry, ...]:
    """The entries of a system.posix_acl_access value; () for anything that is not a version-2 ACL."""
    if len(raw) < 4 or (len(raw) - 4) % 8 or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        return ()
    entries = []
    for offset in range(4, len(raw), 8):
        tag, perm, qualifier = struct.unpack_from("<HHI", raw, offset)
        entries.append(AclEntry(tag, perm & 7, qualifier if tag in (ACL_USER, ACL_GROUP) else None))
    return tuple(entries)


@dataclass(frozen=True)
class Principal:
    """A user as the kernel sees it when the service runs: uid and every group it holds."""

    name: str
    uid: int
    gids: frozenset[int]

    @property
    def is_regular(self) -> bool:
        """A login user (uid >= 1000), not root, a system user such as gb10d, or nobody."""
        return FIRST_REGULAR_UID <= self.uid < NOBODY_UID


@dataclass(frozen=True)
class Node:
    """What lstat (and the ACL attribute) says about one path component."""

    path: str
    uid: int
    gid: int
    mode: int
    owner: str = ""
    group: str = ""
    acl: tuple[AclEntry, ...] = ()

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


def permits(node: Node, who: Principal, want: Want) -> bool:
    """Whether `who` has the access `want` to `node`: the kernel's check (generic_permission, posix_acl_permission)."""
    if who.uid == 0:
        # CAP_DAC_OVERRIDE: everything, except running a file that has no x bit at all.
        return not (want & Want.EXEC) or node.is_dir or bool(node.mode & 0o111)
    bits = int(want)
    if who.uid == node.uid:
        return (node.mode >> 6) & bits == bits
    if node.acl:
        mask = next((e.perm for e in node.acl if e.tag == ACL_MASK), 7)
        named = [e for e in node.acl if e.tag == ACL_USER and e.qualifier == who.uid]
        if named:
            return named[0].perm & mask & bits == bits
        groups = [
            e for e in node.acl
            if (e.tag == ACL_GROUP_OBJ and node.gid in who.gids) or (e.tag == ACL_GROUP and e.qualifier in who.gids)
        ]
        if groups:
            return any(e.perm & mask & bits == bits for e in groups)
        other = next((e.perm for e in node.acl if e.tag == ACL_OTHER), node.mode & 7)
        return other & bits == bits
    if node.gid in who.gids:
        return (node.mode >> 3) & bits == bits
    return node.mode & bits == bits


@dataclass(frozen=True)
class Denial:
    """Where the way to a path is barred for a user: the component, and what was wanted of it."""

    node: Node
    want: Want
    who: Principal

    @property
    def verb(self) -> str:
        """What the user may not do, as the sentence says it."""
        if self.node.is_dir:
            # Not even allowed in: that is what the operator meets first.
            if not permits(self.node, self.who, Want.EXEC):
                return "enter"
            return "write in" if self.want & Want.WRITE else "list"
        return "run" if self.want & Want.EXEC else ("write" if self.want & Want.WRITE else "read")

    def cause(self, role: str = "the service user") -> str:
        """`/home/alice is mode 0750 and the service user gb10d may not enter it`."""
        return f"{self.node.path} is mode {stat.S_IMODE(self.node.mode):04o} and {role} {self.who.name} may not {self.verb} it"


def reach(chain: list[Node], who: Principal, want: Want) -> Denial | None:
    """The first component of `chain` (directories searched in order, then the target) barred to `who`, or None.

    Every directory on the way needs search (x); the last node needs `want`.
    A directory wanted for READ is also searched, as listing it is used to
    find files in it.
    """
    for node in chain[:-1]:
        if not permits(node, who, Want.EXEC):
            return Denial(node, Want.EXEC, who)
    if chain:
        last = chain[-1]
        needed = want | Want.EXEC if last.is_dir and want & (Want.READ | Want.WRITE) else want
        if not permits(last, who, needed):
            return Denial(last, needed, who)
    return None


@dataclass(frozen=True)
class WayOut:
    """One way to give the service the access it lacks: what it does, and the exact command."""

    summary: str
    command: str


def ways_out(denial: Denial, unit: str) -> list[WayOut]:
    """The fixes for a denial, most natural first: run as the owner, or let the service user in through the group.

    Running as the owner applies only to a login user's files; letting in
    through the group adds the service user to the directory's group (and
    the group bit the access needs, if it lacks it), never to root's group.
    """
    node, who = denial.node, denial.who
    ways: list[WayOut] = []
    manager = unit.removesuffix(".service")
    on_unit = "" if manager == "gb10d" else f" --unit {manager}"
    if node.uid >= FIRST_REGULAR_UID and node.owner and node.owner != who.name:
        ways.append(WayOut(
            f"run the service as {node.owner}, who owns it, with the caches {node.owner}'s start script used",
            f"sudo gb10d service-user {node.owner}{on_unit}",
        ))
    if node.path == "/root" and who.uid != 0:
        # root's home is private on purpose: first a place of its own, or the login user whose venv it would be.
        ways.append(WayOut(
            "make the venv outside /root, where the service user may read it, and set vllm.venv to it",
            "sudo python3 -m venv /opt/vllm-venv && sudo /opt/vllm-venv/bin/pip install vllm",
        ))
        ways.append(WayOut("run the service as a login user, with the venv in that user's home", f"sudo gb10d service-user NAME{on_unit}"))
    letter = "".join(c for flag, c in ((Want.READ, "r"), (Want.WRITE, "w"), (Want.EXEC, "x")) if denial.want & flag)
    if node.gid >= FIRST_REGULAR_UID and node.group:
        grant = "" if (node.mode >> 3) & int(denial.want) == int(denial.want) else f"sudo chmod g+{letter} {node.path} && "
        ways.append(WayOut(
            f"keep the user {who.name} and let it {denial.verb} {node.path} as a member of the group {node.group}",
            f"{grant}sudo usermod -aG {node.group} {who.name}",
        ))
    elif not denial.want & Want.WRITE:
        # Never a world-writable directory: a write elsewhere is fixed by choosing another directory.
        ways.append(WayOut(f"let every user {denial.verb} {node.path}", f"sudo chmod o+{letter} {node.path}"))
    return ways


def advice(ways: list[WayOut]) -> list[str]:
    """The ways out as the lines that follow a problem: a heading, then each way with its exact command."""
    if not ways:
        return []
    heading = {1: "the way out:", 2: "two ways out:"}.get(len(ways), f"{len(ways)} ways out:")
    return [heading] + [f"  {'or ' if i else ''}{way.summary}: {way.command}" for i, way in enumerate(ways)]


# --- the shell: stat data and users -------------------------------------------


@dataclass(frozen=True)
class Walked:
    """The components on the way to a path, or why the walk stopped short.

    `missing` is the first component that does not exist; `hidden` the
    first one this process could not look at (its own permissions), in
    which case nothing can be said about the rest.
    """

    chain: list[Node]
    missing: str | None = None
    hidden: str | None = None


def user_name(uid: int) -> str:
    """The name of a uid, or the number when no user has it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    """The name of a gid, or the number when no group has it."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _node(path: str, st: os.stat_result) -> Node:
    owner, group = user_name(st.st_uid), group_name(st.st_gid)
    try:
        acl = parse_acl(os.getxattr(path, "system.posix_acl_access", follow_symlinks=False))
    except OSError:
        acl = ()
    return Node(path, st.st_uid, st.st_gid, st.st_mode, owner, group, acl)


def walk(path: str) -> Walked:
    """lstat every directory searched on the way to an absolute `path`, following symbolic links as the kernel does."""
    pending = list(PurePosixPath(path).parts[1:])
    chain: list[Node] = []
    current = "/"
    links = 0
    try:
        chain.append(_node("/", os.lstat("/")))
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            candidate = os.path.dirname(current) if part == ".." else os.path.join(current, part)
            st = os.lstat(candidate)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    return Walked(chain, missing=candidate)
                target = os.readlink(candidate)
                if target.startswith("/"):
                    current = "/"
                pending = [p for p in PurePosixPath(target).parts if p != "/"] + pending
                continue
            current = candidate
            chain.append(_node(candidate, st))
    except (FileNotFoundError, NotADirectoryError):
        return Walked(chain, missing=candidate)
    except PermissionError:
        return Walked(chain, hidden=candidate)
    return Walked(chain)


def principal(name: str, extra_groups: tuple[str, ...] = ()) -> Principal | None:
    """The user `name` with its primary and supplementary groups (as initgroups gives systemd's User=), or None."""
    try:
        entry = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
    except KeyError:
        return None
    gids = set(os.getgrouplist(entry.pw_name, entry.pw_gid))
    for group in extra_groups:
        try:
            gids.add(grp.getgrnam(group).gr_gid if not group.isdigit() else int(group))
        except KeyError:
            continue
    return Principal(entry.pw_name, entry.pw_uid, frozenset(gids))


def current_principal() -> Principal:
    """This process's own user and groups."""
    uid = os.geteuid()
    return Principal(user_name(uid), uid, frozenset({os.getegid(), *os.getgroups()}))
