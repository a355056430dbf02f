"""The systemd unit around gb10d: who it runs as, what environment and sandbox it gives, and the user drop-in.

`gb10d check-config` checks paths as the service will meet them, so it
asks systemd (`systemctl show`) for the unit's User=, Group=,
SupplementaryGroups=, Environment= (less UnsetEnvironment=) and the
sandbox settings that decide where it may write (ProtectSystem=,
ProtectHome=, ReadWritePaths=, the unit's own directories, PrivateTmp=).
Run by the unit itself, or where systemd does not know the unit, the
answer is this process's own user and environment.

Running the service as the operator's own user (`gb10d service-user
alice`) is a drop-in with User=/Group=; logind's RemoveIPC=yes then
deletes that user's semaphores and shared memory at their last logout,
which kills vLLM's multiprocessing (`FileNotFoundError` in
`SemLock._rebuild`), unless the user lingers.

Parsing and deciding are pure; `query`, `logind_texts`, `lingering` and
`install_user_dropin` are the I/O.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UsageError
from ..base.instance import MAIN_UNIT, SYSTEM_USER
from .access import Principal, current_principal, group_name, principal

# The group of the memory ledger the instances of a machine share (/run/gb10d-ledger, made by the package's tmpfiles.d).
LEDGER_GROUP = "gb10d"
DROPIN_NAME = "50-service-user.conf"
# The unit's cache variables; the user drop-in unsets them so vLLM uses the user's own home as the script did.
CACHE_VARIABLES = ("HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME")
# Where those caches then live, below the user's home; ProtectHome=read-only stays and opens only these.
HOME_CACHE_DIRS = (".cache", ".triton", ".nv")
_HOME_ROOTS = ("/home", "/root", "/run/user")
_SHOW_PROPERTIES = (
    "LoadState", "User", "Group", "SupplementaryGroups", "Environment", "UnsetEnvironment", "ProtectSystem",
    "ProtectHome", "ReadWritePaths", "PrivateTmp", "StateDirectory", "CacheDirectory", "RuntimeDirectory", "LogsDirectory",
)
_QUERY_TIMEOUT_S = 10


def unit_for_config(config: Path) -> str:
    """The unit that reads a config file: /etc/gb10d/NAME.toml is gb10d@NAME's, anything else gb10d.service's."""
    if config.parent == Path("/etc/gb10d") and config.suffix == ".toml":
        return f"gb10d@{config.stem}.service"
    return MAIN_UNIT


def unit_name(cgroup: Path = Path("/proc/self/cgroup"), default: str = "gb10d") -> str:
    """The systemd unit this process runs in (`gb10d@chat.service` -> `gb10d@chat`), for commands in messages.

    Read from the process's own cgroup path, which systemd names after the
    unit; outside a service (a terminal, a test) `default`.
    """
    try:
        text = cgroup.read_text()
    except OSError:
        return default
    for line in text.splitlines():
        for part in reversed(line.rpartition(":")[2].split("/")):
            if part.endswith(".service"):
                return part[: -len(".service")]
    return default


@dataclass(frozen=True)
class Sandbox:
    """The unit's file-system protections that decide where the service may write."""

    protect_system: str = "no"
    protect_home: str = "no"
    writable: tuple[str, ...] = ()  # ReadWritePaths=, PrivateTmp's /tmp and /var/tmp
    owned: tuple[str, ...] = ()  # StateDirectory= and friends: systemd makes them and gives them to the service user

    def allows_write(self, path: str) -> bool:
        """Whether the sandbox leaves `path` writable (permissions aside)."""
        if any(_under(path, root) for root in self.writable + self.owned):
            return True
        if self.protect_home not in ("no", "") and any(_under(path, root) for root in _HOME_ROOTS):
            return False
        if self.protect_system == "strict":
            return any(_under(path, root) for root in ("/dev", "/proc", "/sys"))
        read_only = {"yes": ("/usr", "/boot", "/efi"), "full": ("/usr", "/boot", "/efi", "/etc")}.get(self.protect_system, ())
        return not any(_under(path, root) for root in read_only)

    def allows_read(self, path: str) -> bool:
        """Whether the sandbox leaves `path` visible: ProtectHome=yes and =tmpfs hide the homes."""
        if any(_under(path, root) for root in self.writable + self.owned):
            return True
        return not (self.protect_home in ("yes", "tmpfs") and any(_under(path, root) for root in _HOME_ROOTS))

    def why_read_only(self, path: str) -> str:
        """The setting that makes `path` read-only, for messages."""
        if self.protect_home not in ("no", "") and any(_under(path, root) for root in _HOME_ROOTS):
            return f"ProtectHome={self.protect_home}"
        return f"ProtectSystem={self.protect_system}"


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return root == "/" or path == root or path.startswith(root + "/")


@dataclass(frozen=True)
class ServiceContext:
    """The unit as the service meets it: its user, groups, environment and sandbox, and how they were learnt."""

    unit: str
    user: Principal
    environment: dict[str, str] = field(default_factory=dict)
    sandbox: Sandbox = field(default_factory=Sandbox)
    source: str = "systemd"

    @property
    def home(self) -> str:
        """$HOME in the service: the unit's Environment= if it sets one, else the user's home (systemd sets it for User=)."""
        if self.environment.get("HOME"):
            return self.environment["HOME"]
        try:
            return pwd.getpwuid(self.user.uid).pw_dir
        except KeyError:
            return "/"

    def describe(self) -> str:
        """`gb10d (the user gb10d.service runs as)`, for the check-config summary."""
        return f"{self.user.name} ({self.source})"


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p ...` output as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_environment(value: str) -> dict[str, str]:
    """systemctl show's Environment= value: shell-quoted NAME=value words."""
    try:
        words = shlex.split(value)
    except ValueError:
        words = value.split()
    return dict(word.split("=", 1) for word in words if "=" in word)


def sandbox_of(props: dict[str, str]) -> Sandbox:
    """The Sandbox described by systemctl show's properties."""
    writable = [p.lstrip("-+") for p in props.get("ReadWritePaths", "").split()]
    if props.get("PrivateTmp") == "yes":
        writable += ["/tmp", "/var/tmp"]
    owned = [
        f"{prefix}/{d}"
        for prefix, name in (("/var/lib", "StateDirectory"), ("/var/cache", "CacheDirectory"), ("/run", "RuntimeDirectory"), ("/var/log", "LogsDirectory"))
        for d in props.get(name, "").split()
    ]
    return Sandbox(props.get("ProtectSystem", "no") or "no", props.get("ProtectHome", "no") or "no", tuple(writable), tuple(owned))


def context_from_show(unit: str, props: dict[str, str], who: Principal | None) -> ServiceContext | None:
    """The ServiceContext of a loaded unit; None when systemd does not know it (then this process stands in)."""
    if props.get("LoadState") != "loaded" or who is None:
        return None
    env = parse_environment(props.get("Environment", ""))
    for name in props.get("UnsetEnvironment", "").split():
        env.pop(name.partition("=")[0], None)
    return ServiceContext(unit, who, env, sandbox_of(props), f"the user {unit} runs as")


def query(unit: str, as_user: str | None = None) -> ServiceContext:
    """Ask systemd about `unit`; without systemd or the unit, this process's environment stands in.

    `as_user` replaces the user (the rest still comes from the unit): what
    `check-config --user` checks before the drop-in is written. Raises
    UsageError (exit 78) when there is no such user.
    """
    props = _show(unit)
    groups = tuple(props.get("SupplementaryGroups", "").split()) + ((props["Group"],) if props.get("Group") else ())
    who = principal(as_user or props.get("User") or "root", groups if not as_user else ())
    if who is None:
        raise UsageError(f"no user {as_user or props.get('User')} on this machine: check the name with getent passwd")
    context = context_from_show(unit, props, who)
    if context is None:
        base = this_process(unit)
        if not as_user:
            return base
        # HOME is this process's; the service's would be the user's own (systemd sets it for User=).
        return ServiceContext(unit, who, {k: v for k, v in base.environment.items() if k != "HOME"}, base.sandbox, "--user")
    return ServiceContext(unit, who, context.environment, context.sandbox, "--user") if as_user else context


def this_process(unit: str) -> ServiceContext:
    """This process as the service: its own user, groups and environment, no sandbox known."""
    return ServiceContext(unit, current_principal(), dict(os.environ), Sandbox(), f"this process: systemd does not know {unit}")


def socket_listens(unit: str = "gb10d-front.socket") -> list[str]:
    """The addresses a socket unit listens on as systemd has it (`systemctl show -p Listen`: "[::]:8000 (Stream)"
    each), drop-ins included; empty without systemd or without the unit."""
    value = _show(unit, ("Listen",)).get("Listen", "")
    return [entry.rsplit(" (", 1)[0] for entry in value.split("\n") if entry.strip()] if value else []


def _show(unit: str, properties: tuple[str, ...] = _SHOW_PROPERTIES) -> dict[str, str]:
    """The unit's properties from `systemctl show`; empty without systemd."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return {}
    try:
        done = subprocess.run(
            [systemctl, "show", "-p", ",".join(properties), "--", unit],
            capture_output=True, text=True, timeout=_QUERY_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_show(done.stdout) if done.returncode == 0 else {}


# --- logind's RemoveIPC ------------------------------------------------------------

LOGIND_CONF = Path("/etc/systemd/logind.conf")
LOGIND_DROPIN_DIRS = (Path("/etc/systemd/logind.conf.d"), Path("/run/systemd/logind.conf.d"), Path("/usr/local/lib/systemd/logind.conf.d"), Path("/usr/lib/systemd/logind.conf.d"))
LINGER_DIR = Path("/var/lib/systemd/linger")


def remove_ipc(texts: list[str]) -> bool:
    """logind's effective RemoveIPC= from its config texts in the order it reads them (default yes)."""
    value = True
    for text in texts:
        section = ""
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]").strip()
            elif section == "Login" and (m := re.fullmatch(r"RemoveIPC\s*=\s*(\S*)", line)):
                value = m.group(1).lower() not in ("no", "false", "0", "off")
    return value


def ipc_warning(who: Principal, removes_ipc: bool, lingers: bool, unit: str) -> str | None:
    """The warning for a service run as a login user whose IPC logind will remove at logout, or None."""
    if not who.is_regular or not removes_ipc or lingers:
        return None
    return (
        f"{unit} runs as {who.name} (uid {who.uid}), and logind's RemoveIPC=yes deletes {who.name}'s semaphores and shared "
        f"memory when {who.name}'s last session ends, which kills a running vLLM (FileNotFoundError in SemLock._rebuild); "
        f"keep {who.name} lingering: sudo loginctl enable-linger {who.name}"
    )


def logind_texts() -> list[str]:
    """logind.conf, then its drop-ins by file name (a name in /etc hides the same name further down)."""
    texts = []
    try:
        texts.append(LOGIND_CONF.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        pass
    chosen: dict[str, Path] = {}
    for directory in LOGIND_DROPIN_DIRS:
        try:
            for path in directory.glob("*.conf"):
                chosen.setdefault(path.name, path)
        except OSError:
            continue
    for name in sorted(chosen):
        try:
            texts.append(chosen[name].read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return texts


def lingering(name: str) -> bool:
    """Whether logind keeps `name`'s user manager (and so its IPC) after the last logout."""
    return (LINGER_DIR / name).exists()


# --- the drop-in that runs the service as a login user ---------------------------


def systemd_running(run: Path = Path("/run/systemd/system")) -> bool:
    """Whether systemd is this machine's init (sd_booted()): only then does a unit drop-in mean anything."""
    return run.is_dir()


def dropin_dir(unit: str) -> Path:
    """Where `systemctl edit UNIT` puts drop-ins."""
    return Path("/etc/systemd/system") / f"{unit}.d"


def user_dropin(user: str, group: str, home: str) -> str:
    """The drop-in that runs gb10d as `user`, with the caches `user`'s own start script used, hardening kept."""
    writable = " ".join(f"-{home}/{d}" for d in HOME_CACHE_DIRS)
    return (
        f"# Written by `gb10d service-user {user}`: gb10d and vLLM run as {user}, with the\n"
        f"# model and compile caches {user}'s start script used. `gb10d service-user {SYSTEM_USER}`\n"
        "# removes this file and the service runs as the system user again.\n"
        "[Service]\n"
        f"User={user}\n"
        f"Group={group}\n"
        f"# vLLM's caches stay in {home} (systemd sets HOME for User=): the model in\n"
        "# ~/.cache/huggingface, torch.compile in ~/.cache/vllm, Triton in ~/.triton.\n"
        f"UnsetEnvironment={' '.join(CACHE_VARIABLES)}\n"
        f"# ProtectHome=read-only stays; vLLM may write only in these cache directories of {home}.\n"
        f"ReadWritePaths={writable}\n"
        f"# The memory ledger the gb10d instances of this machine share (/run/gb10d-ledger) is the group {LEDGER_GROUP}'s.\n"
        f"SupplementaryGroups={LEDGER_GROUP}\n"
    )


@dataclass(frozen=True)
class Installed:
    """What `install_user_dropin` did, line by line, for the operator."""

    lines: list[str]


def install_user_dropin(unit: str, user: str) -> Installed:
    """Write (or, for the system user, remove) the user drop-in, make the cache directories, keep the user lingering, reload systemd."""
    path = dropin_dir(unit) / DROPIN_NAME
    done: list[str] = []
    if user == SYSTEM_USER:
        if path.exists():
            path.unlink()
            done.append(f"removed {path}: {unit} runs as {SYSTEM_USER} again, with its caches in /var/cache/gb10d")
        else:
            done.append(f"{unit} already runs as {SYSTEM_USER} ({path} does not exist)")
    else:
        entry = pwd.getpwnam(user)
        group = group_name(entry.pw_gid)
        for name in HOME_CACHE_DIRS:
            directory = Path(entry.pw_dir) / name
            if not directory.exists():
                # The home stays read-only for the service: a cache directory it would create must exist first.
                directory.mkdir(mode=0o755)
                os.chown(directory, entry.pw_uid, entry.pw_gid)
                done.append(f"created {directory} for {user}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(user_dropin(user, group, entry.pw_dir), encoding="utf-8")
        done.append(f"wrote {path}: {unit} runs as {user}")
        done += _linger(user)
    done += _systemctl("daemon-reload")
    return Installed(done)


def _linger(user: str) -> list[str]:
    """Keep `user` lingering, so logind's RemoveIPC= leaves vLLM's semaphores alone; say how if it cannot."""
    if lingering(user):
        return [f"{user} already lingers: logind keeps its semaphores and shared memory after logout"]
    loginctl = shutil.which("loginctl")
    result = subprocess.run([loginctl, "enable-linger", user], capture_output=True, text=True, timeout=30) if loginctl else None
    if result is not None and result.returncode == 0:
        return [f"ran loginctl enable-linger {user}: logind keeps {user}'s semaphores and shared memory after logout (RemoveIPC=)"]
    why = (result.stderr.strip() if result is not None else "") or "loginctl is not installed"
    return [f"warning: could not make {user} linger ({why}); run: sudo loginctl enable-linger {user}"]


def _systemctl(*words: str) -> list[str]:
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return ["systemctl is not installed; nothing to reload"]
    result = subprocess.run([systemctl, *words], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return [f"warning: systemctl {' '.join(words)} failed: {result.stderr.strip()}"]
    return [f"ran systemctl {' '.join(words)}"]
